"""The megatron-core actor (student trainer). megatron is imported only inside this package,
and only by `megatron_actor`, `mcore_model`, `attention`, `optimizer`, `checkpointing` and `cpu_compat`
when they run."""
