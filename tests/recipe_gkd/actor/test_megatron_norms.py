"""The actor's decoder block with Apex installed and Transformer Engine absent (defect of issue 27).

megatron-core 0.16.1 chooses the final norm of a block built from a layer spec at import time:
FusedLayerNorm when `import apex` works and Transformer Engine does not (transformer/transformer_block.py,
`LayerNormImpl`), and FusedLayerNorm asserts normalization == "LayerNorm". An empty `apex` package on
the path reproduces exactly that import-time choice; the build runs in a subprocess so megatron's
module state never leaks into the test process.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from recipe_gkd.plan.ports import reserve_ports

BUILD = """
import sys
from transformers import AutoConfig
from recipe_gkd.actor.cpu_compat import enable_cpu_compat
enable_cpu_compat()
import torch.distributed as dist
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=0, world_size=1)
from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
parallel_state.initialize_model_parallel(1, 1)
model_parallel_cuda_manual_seed(1)
from megatron.core.transformer import transformer_block
print("apex", transformer_block.HAVE_APEX, "te", transformer_block.HAVE_TE, transformer_block.LayerNormImpl.__name__)
from recipe_gkd.actor import hf_convert, mcore_model
from recipe_gkd.models import read_hf_arch
from recipe_gkd.parallel_layout import ParallelLayout
arch = read_hf_arch(AutoConfig.from_pretrained(sys.argv[1]))
config = mcore_model.build_transformer_config(
    arch, ParallelLayout(), bf16=False, on_cpu=True, recompute="none", attention="sdpa"
)
model = mcore_model.build_gpt_model(arch, config)
norms = {type(m).__name__ for name, m in model.named_modules() if name.endswith(("layernorm", "_layernorm"))}
print("final", type(model.decoder.final_layernorm).__name__, "norms", sorted(norms))
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_an_rmsnorm_student_builds_with_apex_installed_and_no_transformer_engine(
    tmp_path: Path, clean_env: dict[str, str]
) -> None:
    from recipe_gkd.offline_models import build_tiny_causal_lm

    model_dir = build_tiny_causal_lm(tmp_path / "qwen3", seed=0, family="qwen3")
    fake_apex = tmp_path / "site" / "apex"
    fake_apex.mkdir(parents=True)
    (fake_apex / "__init__.py").write_text('"""Apex as megatron sees it when installed: importable."""\n')
    env = dict(clean_env, PYTHONPATH=f"{tmp_path / 'site'}:{clean_env['PYTHONPATH']}", OMP_NUM_THREADS="1")
    port = str(reserve_ports(1)[0])
    done = subprocess.run(
        [sys.executable, "-c", BUILD, str(model_dir), port], env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "apex True te False FusedLayerNorm" in done.stdout  # the environment of the defect
    # torch's RMSNorm everywhere, the final norm included (megatron's WrappedTorchNorm builds torch.nn.RMSNorm).
    assert "final RMSNorm" in done.stdout, done.stdout
    assert "FusedLayerNorm" not in done.stdout.split("final", 1)[1]
