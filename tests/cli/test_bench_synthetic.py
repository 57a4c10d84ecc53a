"""``hpcdp-bench synthetic`` under mpirun: Horovod's output lines, one JSON record per mode,
and how the records' fields relate (serial test; no timings are asserted)."""
import json
import re

import pytest

from launch import ran_on_cuda, run_mpi

pytest.importorskip("torch")

REQUIRED = {"bench", "model", "mode", "compression", "np", "throughput", "unit", "ratio_to_ddp",
            "scaling_efficiency", "ratio_to", "exposed_comm_s", "bytes_sent_per_step", "per_rank",
            "cpu_s_per_step", "progress_cpu_s_per_step"}
SMALL = ["--num-warmup-batches", "2", "--num-batches-per-iter", "1", "--num-iters", "3"]


def synthetic(np_, *args, timeout=200, env=None):
    return run_mpi(np_, ["-m", "hpcdp.cli.bench", "synthetic", *args], timeout=timeout, env=env)


def parse(p):
    """``(blocks, records)``: Horovod's lines per mode, and the JSON records in order."""
    assert p.returncode == 0, p.stdout + p.stderr
    blocks, records = {}, []
    current = None
    for line in p.stdout.splitlines():
        if line.startswith("{"):
            records.append(json.loads(line))
        elif line.startswith("Mode: "):
            current = blocks.setdefault(line[len("Mode: "):], [])
        elif current is not None:
            current.append(line)
    return blocks, records


def check_horovod_block(lines, what, dev, np_, iters, per_rank):
    """Horovod's lines: one per iteration, then mean +-1.96 sigma per worker and in total."""
    unit = what.lower()
    assert len(lines) == iters + 2, lines
    for i, line in enumerate(lines[:iters]):
        assert re.fullmatch(rf"Iter #{i}: \d+\.\d {unit}/sec per {dev}", line), line
    m = re.fullmatch(rf"{what}/sec per {dev}: (\d+\.\d) \+-(\d+\.\d)", lines[iters])
    assert m, lines[iters]
    assert float(m.group(1)) == pytest.approx(per_rank, abs=0.051)
    t = re.fullmatch(rf"Total {unit}/sec on {np_} {dev}\(s\): (\d+\.\d) \+-(\d+\.\d)", lines[iters + 1])
    assert t, lines[iters + 1]
    assert float(t.group(1)) == pytest.approx(np_ * per_rank, abs=0.051 * np_)


@pytest.mark.timeout(300)
def test_resnet_modes_print_horovods_lines_and_a_record_each():
    p = synthetic(2, "--model", "resnet18", "--image-size", "32", "--batch-size", "4", *SMALL,
                  "--modes", "hpcdp,hpcdp-sync,hpcdp-syncbn,ddp,ddp-hpcdp,local", env={"HPCDP_ALGO": "ring"})
    assert p.stdout.startswith("Model: resnet18\nBatch size: 4\nNumber of CPUs: 2\nRunning warmup...\n"
                               "Running benchmark...\n"), p.stdout
    blocks, recs = parse(p)
    modes = ["hpcdp", "hpcdp-sync", "hpcdp-syncbn", "ddp", "ddp-hpcdp", "local"]
    assert [r["mode"] for r in recs] == modes and list(blocks) == modes
    by = {r["mode"]: r for r in recs}
    for r in recs:
        assert REQUIRED <= set(r), r
        assert (r["model"], r["np"], r["unit"], r["image_size"], r["batch_size"]) == (
            "resnet18", 2, "img/s", 32, 4)
        assert r["lr"] == pytest.approx(0.02) and r["momentum"] == 0  # Horovod's: 0.01 x ranks
        assert r["join"] is False
        assert r["throughput"] == pytest.approx(2 * r["per_rank"]) and r["throughput"] > 0
        check_horovod_block(blocks[r["mode"]], "Img", "CPU", 2, 3, r["per_rank"])
        assert set(r["ratio_to"]) == {m for m in by if m != r["mode"]}
        assert r["ratio_to_ddp"] == (1.0 if r["mode"] == "ddp" else r["ratio_to"]["ddp"])
        assert r["scaling_efficiency"] == (1.0 if r["mode"] == "local" else r["ratio_to"]["local"])
        assert 0 <= r["exposed_comm_s"]
        assert 0 <= r["progress_cpu_s_per_step"] < r["cpu_s_per_step"], r
    assert by["local"]["exposed_comm_s"] == 0 and by["local"]["bytes_sent_per_step"] == 0
    # the progress thread drives hpcdp's allreduces only
    assert by["hpcdp"]["progress_cpu_s_per_step"] > 0
    assert by["local"]["progress_cpu_s_per_step"] == by["ddp"]["progress_cpu_s_per_step"] == 0
    # hpcdp's ring moves 2 (n-1)/n of the gradients per step at n = 2: one copy of them
    n_params = 11_689_512
    for m in ("hpcdp", "hpcdp-sync", "hpcdp-syncbn"):
        assert by[m]["bytes_sent_per_step"] >= 4 * n_params, by[m]
        assert by[m]["algo"] == "ring"
    assert by["ddp"]["bytes_sent_per_step"] is None and by["ddp-hpcdp"]["bytes_sent_per_step"] is None


@pytest.mark.timeout(300)
def test_gpt2_compressions_pair_with_torchs_hooks():
    """Every hpcdp mode once per compressor; ddp once per compressor torch has a hook for
    (none, fp16, powersgd; no onebit); tokens/s; fewer bytes when compressed (three warm-up
    steps: the buckets' re-layout after the first restarts powersgd's two exact ones)."""
    p = synthetic(2, "--model", "gpt2-mini", "--seq-len", "16", "--batch-size", "2", *SMALL,
                  "--num-warmup-batches", "3", "--bucket-mb", "10",
                  "--compression", "none,fp16,onebit,powersgd:2", "--modes", "hpcdp,ddp",
                  env={"HPCDP_ALGO": "ring"})  # every fp32 byte counted (shm sends none)
    blocks, recs = parse(p)
    assert [(r["mode"], r["compression"]) for r in recs] == [
        ("hpcdp", None), ("hpcdp", "fp16"), ("hpcdp", "onebit"), ("hpcdp", "powersgd:2"),
        ("ddp", None), ("ddp", "fp16"), ("ddp", "powersgd:2")]
    assert set(blocks) == {"hpcdp", "hpcdp+fp16", "hpcdp+onebit", "hpcdp+powersgd:2", "ddp", "ddp+fp16",
                           "ddp+powersgd:2"}
    for r in recs:
        assert r["unit"] == "tokens/s" and r["seq_len"] == 16 and r["scaling_efficiency"] is None
        assert r.get("bucket_cap_mb") == (10.0 if r["mode"] == "hpcdp" else None)
        check_horovod_block(blocks[r["mode"] + (f"+{r['compression']}" if r["compression"] else "")],
                            "Tokens", "CPU", 2, 3, r["per_rank"])
        assert "ddp+powersgd:2" in r["ratio_to"] or (r["mode"], r["compression"]) == ("ddp", "powersgd:2")
    by = {(r["mode"], r["compression"]): r["bytes_sent_per_step"] for r in recs}
    fp32 = by[("hpcdp", None)]
    assert by[("hpcdp", "fp16")] < 0.51 * fp32
    assert by[("hpcdp", "onebit")] < 0.1 * fp32
    assert by[("hpcdp", "powersgd:2")] < 0.2 * fp32


@pytest.mark.timeout(300)
def test_recsys_sparse_tables_send_rows_not_tables():
    """Samples/s; the sparse tables' rows (32 samples x 4 tables x 4 ids of 16 floats at
    most) and the MLP's 4,290 gradients, not the tables' 640,000, on hpcdp's wire; torch
    DDP over the "hpcdp" backend reduces the sparse gradients too."""
    p = synthetic(2, "--model", "recsys-mini", "--batch-size", "32", *SMALL,
                  "--modes", "hpcdp,ddp,ddp-hpcdp,local", env={"HPCDP_ALGO": "ring"})
    blocks, recs = parse(p)
    assert [r["mode"] for r in recs] == ["hpcdp", "ddp", "ddp-hpcdp", "local"]
    for r in recs:
        assert r["unit"] == "samples/s" and "image_size" not in r and "seq_len" not in r, r
        check_horovod_block(blocks[r["mode"]], "Samples", "CPU", 2, 3, r["per_rank"])
    rows = 32 * 4 * 4 * (16 * 4 + 8)  # float32 rows and int64 ids, before pickling
    assert 4 * 4_290 < recs[0]["bytes_sent_per_step"] < 2 * (rows + 4 * 4_290), recs[0]


@pytest.mark.timeout(120)
def test_one_rank_and_horovods_fp16_flag_inside_join():
    p = synthetic(1, "--model", "resnet18", "--image-size", "32", "--batch-size", "2",
                  "--num-warmup-batches", "1", "--num-batches-per-iter", "1", "--num-iters", "2",
                  "--fp16-allreduce", "--modes", "hpcdp,ddp,local", "--join")
    _blocks, recs = parse(p)
    assert [(r["mode"], r["compression"], r["np"], r["join"]) for r in recs] == [
        ("hpcdp", "fp16", 1, True), ("ddp", "fp16", 1, True), ("local", None, 1, True)]
    assert recs[0]["bytes_sent_per_step"] == 0  # one rank: nothing to send


@pytest.mark.timeout(120)
@pytest.mark.parametrize("args,message", [
    (["--model", "vgg16"], "unknown model 'vgg16'"),
    (["--modes", "hpcdp,naive"], "--modes takes names from"),
    (["--compression", "zip"], "--compression"),
    (["--model", "gpt2-mini", "--seq-len", "4096"], "4096"),
    (["--join", "--compression", "none,onebit"], "--join takes no onebit"),
])
def test_bad_arguments_exit_2_with_the_reason(args, message):
    p = synthetic(2, *args, "--batch-size", "1", "--num-iters", "1", "--num-warmup-batches", "0",
                  "--num-batches-per-iter", "1", timeout=100)
    assert p.returncode == 2, p.stdout + p.stderr
    assert message in p.stderr, p.stderr


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_device_cuda_runs_on_a_gpu_or_is_refused():
    p = synthetic(1, "--model", "resnet18", "--image-size", "32", "--batch-size", "2", "--device", "cuda",
                  "--num-warmup-batches", "1", "--num-batches-per-iter", "1", "--num-iters", "2",
                  "--modes", "hpcdp,ddp,local", timeout=100)
    if ran_on_cuda(p, "sees no CUDA device"):
        _, recs = parse(p)
        assert [r["device"] for r in recs] == ["cuda"] * 3
