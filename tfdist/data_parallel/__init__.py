"""The data-parallel gradient path: gradient buckets and communication hooks (fp16/bf16, PowerSGD), `no_sync`
accumulation, uneven per-rank data (every rank agrees whether a step happens), and distributed inputs that keep
one iterator across epochs. The data-parallel strategies (Mirrored, MultiWorker, Horovod) compose these."""
