"""Transport: the ring schedule (pure), the ring itself, the progress engine,
buffers of every memory kind and CUDA-awareness detection. Nothing in here
knows about torch modules or compression."""
