"""tools/gpu/check.sh, the one command a CUDA machine runs, selects the device tests by
their ``gpu`` marker: every test module that can run on real CUDA must carry it."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: what a test that runs on a real GPU (or asks for one) contains
NEEDS_CUDA = re.compile(r"cuda\.is_available\(\)|cuda_or_skip\(|ran_on_cuda\(|\"--device\", \"cuda\"|device=\"cuda\"")


def test_check_sh_selects_the_gpu_marker_serially_and_under_mpirun():
    script = (ROOT / "tools/gpu/check.sh").read_text()
    runs = [line for line in script.splitlines() if "python -m pytest" in line]
    assert len(runs) == 2 and all("-m gpu" in line for line in runs), runs
    assert "--only-mpi" in runs[1] and "mpirun" in runs[1]


def test_every_test_module_that_can_use_a_gpu_is_marked_gpu():
    unmarked = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        text = path.read_text()
        if path.name != Path(__file__).name and NEEDS_CUDA.search(text) and "mark.gpu" not in text:
            unmarked.append(str(path.relative_to(ROOT)))
    assert not unmarked, f"test modules using CUDA without @pytest.mark.gpu: {unmarked}"
