"""A model of a real architecture with random weights, saved as a directory a deployment can load (MODEL=the path).

A step's speed depends on the shapes, not on the weights' values, so where the real weights cannot be had (a lent
GPU machine reaches no network, and a call to it carries 64 MiB, not Qwen2.5-Coder-1.5B's 3 GB) this measures plain,
compiled and eager decoding truthfully. Acceptance it does not: random drafts are rejected. A draft that is the
target itself (pass the same directory as --draft-model) accepts every draft, the upper bound of what one brings.

    python3 benchmarks/random_model.py --like qwen2.5-coder-1.5b-instruct --out /tmp/q15
    python3 benchmarks/load.py --model /tmp/q15 --device cuda --workload code --concurrency 1,8 \\
        --draft-model /tmp/q15 --k 4 --depctl auto --depctl auto+eager

The tokenizer is a byte-level one (every byte a token, a chat template; the tests' tokenizer), so prompts are
longer in tokens than with the real tokenizer. The shapes are the models' published configurations.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = {  # the published config.json of each model: what a step's cost depends on
    "qwen2.5-coder-1.5b-instruct": dict(
        model_type="qwen2",
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=32768,
    ),
    "qwen2.5-coder-0.5b-instruct": dict(
        model_type="qwen2",
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=32768,
    ),
    "smollm2-135m-instruct": dict(
        model_type="llama",
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        tie_word_embeddings=True,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=8192,
    ),
    "tiny": dict(  # a small Llama, not a real model's shape: for checking a benchmark's logic in seconds on a CPU
        model_type="llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=1024,
    ),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--like", choices=sorted(SHAPES), required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    params = _parameters(save_random(SHAPES[args.like], args.out, args.seed))
    print(f"{args.like}, random weights: {params / 1e6:.0f}M parameters in {args.out}")
    return 0


def save_random(shape: dict, out: Path, seed: int = 0) -> Path:
    """A model of ``shape`` (a config's fields) with random bf16 weights and the byte-level tokenizer, saved in
    ``out``; returns ``out``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.tiny import byte_tokenizer

    shape = dict(shape)
    config = AutoConfig.for_model(
        shape.pop("model_type"), **shape, bos_token_id=256, eos_token_id=258, pad_token_id=256, dtype="bfloat16"
    )
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    byte_tokenizer().save_pretrained(out)
    return out


def _parameters(model_dir: Path) -> int:
    from safetensors import safe_open

    total = 0
    for path in model_dir.glob("*.safetensors"):
        with safe_open(path, "pt") as f:
            total += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    return total


if __name__ == "__main__":
    sys.exit(main())
