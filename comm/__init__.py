"""Communication building blocks for expert parallelism on torch.distributed (installed as
``tritonmoe.comm``). This package never imports the layer."""
