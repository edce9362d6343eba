"""The megatron-core actor (student trainer). megatron is imported only inside this package,
and only by `megatron_actor`, `hf_convert.build_*` and `cpu_compat` when they run."""
