"""A tiny random-weight Llama that real vLLM can serve, built locally in seconds.

No machine of this project can download weights, yet the real-engine tests need a model that
exercises vLLM's real scheduler, prefix cache and KV transfer. Quality is irrelevant; shapes
are not: head_dim 64 is the smallest the CPU attention backend accepts (16 fails with
"Unsupported CPU attention configuration").

`build_tiny_model(dir)` writes config + safetensors + a byte-level BPE tokenizer (trained on
text generated here from a fixed seed, so the result does not depend on the Python version or
on files of the machine) with a chat template. It is deterministic and cached: a directory
that already holds a finished build of the same recipe is returned untouched.

CLI: `python -m engine_launcher.tiny_model DIR`.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path

# Bump when anything below changes what is written, so cached builds are rebuilt.
RECIPE_VERSION = "tiny-llama-v1"
_MARKER = ".tiny_model_recipe"

SEED = 1234
VOCAB_SIZE = 2000
MAX_POSITION_EMBEDDINGS = 4096

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
PAD = "<|pad|>"
ROLE_START = "<|start_header|>"
ROLE_END = "<|end_header|>"
TURN_END = "<|eot|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, ROLE_START, ROLE_END, TURN_END]

# Minimal Llama-3-like chat format; string contents only (vLLM detects the "string" format).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '" + ROLE_START + "' + message['role'] + '" + ROLE_END + "\\n' }}"
    "{{ message['content'] }}{{ '" + TURN_END + "\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '" + ROLE_START + "assistant" + ROLE_END + "\\n' }}{% endif %}"
)

_WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "it",
    "for",
    "as",
    "with",
    "was",
    "on",
    "be",
    "by",
    "this",
    "are",
    "from",
    "at",
    "or",
    "an",
    "have",
    "not",
    "which",
    "but",
    "all",
    "they",
    "one",
    "had",
    "there",
    "can",
    "were",
    "been",
    "has",
    "their",
    "more",
    "if",
    "will",
    "would",
    "other",
    "what",
    "when",
    "out",
    "up",
    "about",
    "into",
    "them",
    "some",
    "could",
    "time",
    "so",
    "than",
    "then",
    "only",
    "its",
    "two",
    "may",
    "these",
    "first",
    "any",
    "new",
    "like",
    "over",
    "such",
    "our",
    "also",
    "most",
    "after",
    "where",
    "just",
    "know",
    "way",
    "well",
    "back",
    "through",
    "much",
    "before",
    "must",
    "right",
    "how",
    "even",
    "because",
    "good",
    "each",
    "those",
    "people",
    "state",
    "take",
    "every",
    "between",
    "cache",
    "block",
    "token",
    "prefix",
    "request",
    "engine",
    "router",
    "model",
    "stream",
    "prompt",
    "decode",
    "prefill",
    "queue",
    "latency",
    "thread",
    "memory",
    "batch",
    "vector",
    "matrix",
    "kernel",
    "server",
    "client",
    "socket",
    "buffer",
    "message",
    "number",
    "string",
    "list",
    "value",
    "return",
    "class",
    "import",
    "function",
    "module",
    "object",
    "error",
    "result",
    "file",
    "path",
    "line",
    "data",
    "config",
    "option",
    "default",
    "python",
    "system",
    "process",
    "signal",
    "timeout",
    "retry",
    "open",
    "close",
    "read",
    "write",
    "start",
    "stop",
    "run",
    "wait",
    "ready",
    "health",
    "metric",
    "count",
    "total",
    "rate",
    "hit",
    "miss",
    "river",
    "mountain",
    "garden",
    "winter",
    "summer",
    "morning",
    "evening",
    "city",
    "village",
    "road",
    "bridge",
    "window",
    "light",
    "water",
    "stone",
    "green",
    "blue",
    "red",
    "yellow",
    "quiet",
    "slow",
    "quick",
    "small",
    "large",
    "old",
    "young",
    "warm",
    "cold",
]


def _corpus(seed: int = SEED, sentences: int = 12000) -> list[str]:
    """Deterministic training text: prose-like sentences, code-like lines, numbers."""
    rng = random.Random(seed)
    lines: list[str] = []
    for i in range(sentences):
        kind = i % 4
        words = [rng.choice(_WORDS) for _ in range(rng.randint(5, 16))]
        if kind == 0:
            lines.append(" ".join(words).capitalize() + rng.choice(".!?"))
        elif kind == 1:
            name = "_".join(words[:2])
            args = ", ".join(words[2:4])
            lines.append(f"def {name}({args}):\n    return {words[4]}[{rng.randint(0, 99)}]")
        elif kind == 2:
            lines.append(f"{words[0]} = {rng.randint(0, 10**6)} + {rng.random():.4f}  # {words[1]}")
        else:
            lines.append(", ".join(words).title() + f" ({rng.randint(1900, 2100)})")
    return lines


def _train_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    # Prepend BOS like Llama tokenizers do (the chat template adds it itself and vLLM's chat
    # path renders with add_special_tokens=False, so it is not doubled there).
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    # transformers leaves the tokenizer's __init__ unannotated.
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=MAX_POSITION_EMBEDDINGS,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))


def _write_model(out: Path) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(out))
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        # Recorded in config.json for vLLM; the typed signature no longer lists this alias.
        torch_dtype="float32",  # type: ignore[call-arg]
    )
    torch.manual_seed(SEED)
    # transformers' model __init__ is unannotated and its typed `.to` wrapper takes no dtype.
    model = LlamaForCausalLM(config).to(torch.float32)  # type: ignore[no-untyped-call, arg-type]
    model.save_pretrained(str(out), safe_serialization=True)


def is_built(model_dir: Path | str) -> bool:
    marker = Path(model_dir) / _MARKER
    return marker.is_file() and marker.read_text().strip() == RECIPE_VERSION


def build_tiny_model(model_dir: Path | str) -> Path:
    """Build (or reuse) the tiny model in `model_dir`; returns the directory."""
    target = Path(model_dir).resolve()
    if is_built(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build next to the target and rename at the end, so a concurrent builder or an
    # interrupted build never leaves a half-written model behind a valid marker.
    staging = Path(tempfile.mkdtemp(prefix=".tiny-model-", dir=target.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; a served model dir may be shared
    try:
        _train_tokenizer(staging)
        _write_model(staging)
        (staging / "cachehit_tiny_model.json").write_text(
            json.dumps({"recipe": RECIPE_VERSION, "seed": SEED}, indent=2) + "\n"
        )
        (staging / _MARKER).write_text(RECIPE_VERSION + "\n")
        if target.exists():
            if is_built(target):  # another builder won the race
                return target
            shutil.rmtree(target)
        os.replace(staging, target)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0].startswith("-"):
        print("usage: python -m engine_launcher.tiny_model DIR", file=sys.stderr)
        return 2
    print(build_tiny_model(argv[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
