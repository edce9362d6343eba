"""recipe_gkd: an orchestrator for on-policy knowledge distillation (GKD) of LLMs.

Importing this package must stay cheap: it never imports vllm or megatron.
"""

__version__ = "0.1.0"
