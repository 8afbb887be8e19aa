"""Tiny random models and a byte-level tokenizer, built inside the tests: no network, no downloads."""

from __future__ import annotations

from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# a template that renders tools and writes calls as Qwen2.5's does (Hermes style), on the same byte-level tokens
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools><|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] %}{{ m['content'] }}{% endif %}"
    "{% for c in m['tool_calls'] or [] %}<tool_call>\n{\"name\": \"{{ c['function']['name'] }}\", "
    "\"arguments\": {{ c['function']['arguments'] | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Llama 3.1's own template (as Meta ships it with the model): tools rendered its way, calls written as
# {"name": ..., "parameters": ...}
LLAMA31_TEMPLATE = (Path(__file__).parent / "templates" / "llama-3.1-8b-instruct.jinja").read_text()
# Mistral Nemo's own template (v3 format): tools in [AVAILABLE_TOOLS], calls as [TOOL_CALLS][{...}, ...], 9-letter ids
MISTRAL_TEMPLATE = (Path(__file__).parent / "templates" / "mistral-nemo-instruct-2407.jinja").read_text()
# Mistral Small 3.2's own template (v11 format): calls as [TOOL_CALLS]name[CALL_ID]id[ARGS]{...}, one marker a call
MISTRAL_V11_TEMPLATE = (Path(__file__).parent / "templates" / "mistral-small-3.2-24b-instruct-2506.jinja").read_text()
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB = 256 + len(SPECIALS) + 1  # bytes, specials, one padding row (as real models pad their tables)
# a request that must still be running when a test acts (a disconnect, a drain, Ctrl-C): a tiny model with room for
# LONG_ANSWER tokens, which take seconds to write on any machine, so the test never races the machine's speed
LONG = 32768
LONG_ANSWER = 30000


def byte_tokenizer(byte_offset: int = 0, chat_template: str = CHAT_TEMPLATE, specials: tuple[str, ...] = ()):
    """A byte-level BPE tokenizer with no merges: every byte is one token; ids 256.. are special tokens (SPECIALS,
    then ``specials``: a model built on it needs a wider vocabulary).

    ``byte_offset`` rotates the byte ids: a tokenizer with the same tokens under different ids, i.e. one a draft
    model must not be paired with."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    # order ids by byte value so that id == byte for the 256 plain tokens
    table = _bytes_to_unicode()
    vocab = {table[b]: (b + byte_offset) % 256 for b in range(256)}
    assert set(vocab) == set(byte_chars)
    for i, tok in enumerate(SPECIALS + list(specials)):
        vocab[tok] = 256 + i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS + list(specials))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = chat_template
    return fast


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's printable mapping of bytes, which tokenizers' ByteLevel uses
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def tiny_llama(seed: int = 0, layers: int = 2, hidden: int = 64, vocab: int = VOCAB, max_positions: int = 512):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        bos_token_id=256,
        eos_token_id=258,
        pad_token_id=256,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    # random init with std 0.02 gives near-flat logits; widen them so greedy ties (and fp round-off flips) are
    # vanishingly rare and the model has definite preferences, like a trained one
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 0.5)
        # ...and mostly ASCII, so its text survives a decode/encode round trip (bytes >= 128 alone are not
        # valid UTF-8); the tests of predicted outputs send generated text back as a prediction
        model.lm_head.weight[128:] *= 0.1
    return model.eval()


def save_tiny(
    path: Path, seed: int = 0, byte_offset: int = 0, chat_template: str = CHAT_TEMPLATE, specials=(), **kwargs
) -> Path:
    """specials: one more special token fits the model's padding row (more need a wider ``vocab``)."""
    assert len(specials) <= kwargs.get("vocab", VOCAB) - 256 - len(SPECIALS)
    model = tiny_llama(seed, **kwargs)
    model.save_pretrained(path)
    byte_tokenizer(byte_offset, chat_template, specials).save_pretrained(path)
    return path


def save_tiny_head(
    path: Path,
    target_dir: Path,
    seed: int = 0,
    draft_vocab: int = 96,
    verifier: str | None = None,
    extra: dict | None = None,
):
    """A random EAGLE-3 head for the tiny model saved in ``target_dir``, in the speculators format: trained for it
    (its fingerprint), named ``verifier`` (default: the directory), with ``extra`` as its ``depctl`` record."""
    from transformers import AutoModelForCausalLM

    from depctl_runtime.model import eagle_format
    from depctl_runtime.model.eagle import EagleConfig, EagleHead

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    head = EagleHead(EagleConfig.for_target(target.config, draft_vocab))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name != "embed_tokens.weight":
                p.normal_(0, 0.3)
    size = head.config.draft_vocab_size
    head.set_vocabulary(torch.arange(0, 2 * size, 2) if 2 * size <= head.config.vocab_size else torch.arange(size))
    fingerprint = eagle_format.fingerprint(target)
    eagle_format.save(
        head,
        path,
        {"name_or_path": verifier or str(target_dir), "fingerprint": fingerprint},
        speculative_tokens=4,
        extra=extra,
    )
    return path


# ---- other architectures: sliding windows (Qwen2, Gemma3), biases on q/k/v (Qwen2), an EAGLE-3 head ----
WINDOW = 8  # the sliding-window models' window: short, so that tests cross it
# what every tiny architecture shares; each adds its own layers and attention pattern
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


def tiny_qwen2_sliding():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        **SMALL,
        num_hidden_layers=2,
        use_sliding_window=True,
        sliding_window=WINDOW,
        max_window_layers=1,
        layer_types=["full_attention", "sliding_attention"],
        tie_word_embeddings=False,
    )
    return _widen(Qwen2ForCausalLM(config))


def tiny_gemma3():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(
        **SMALL,
        num_hidden_layers=3,
        head_dim=16,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
    )
    return _widen(Gemma3ForCausalLM(config))


def _widen(model):
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 0.5)  # definite preferences, as tiny_llama's
    return model.eval()


def tiny_qwen2(seed: int = 0):
    """Qwen2 has biases on q, k and v (and none on o): the fused projection must carry them."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(**SMALL, num_hidden_layers=2, tie_word_embeddings=True)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
        model.model.embed_tokens.weight.normal_(0, 0.5)
    return model.eval()


def tiny_head(seed: int = 0, vocab: int = 50, draft_vocab: int = 20):
    from depctl_runtime.model.eagle import EagleConfig, EagleHead

    torch.manual_seed(seed)
    config = EagleConfig(
        hidden_size=32,
        target_hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=48,
        vocab_size=vocab,
        draft_vocab_size=draft_vocab,
        aux_layers=(0, 1, 2),
    )
    head = EagleHead(config)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.3)
    head.set_vocabulary(torch.arange(0, vocab, vocab // draft_vocab)[:draft_vocab])
    return head.eval()


def train_tiny_head(model_dir, folder, *extra: str, prompts: int = 12) -> str:
    """``python -m depctl_runtime.training`` for a tiny model, briefly, on ``prompts`` prompts written in ``folder``
    (the head in ``folder/head``); its stdout, the JSON lines it printed."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    data = Path(folder) / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"question {i}"}) + "\n" for i in range(prompts)))
    train = [sys.executable, "-m", "depctl_runtime.training", str(model_dir), "--out", str(Path(folder) / "head")]
    train += ["--data", str(data), "--minutes", "0.2", "--max-tokens", "8", "--draft-vocab", "64", "--no-compile"]
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run(train + list(extra), cwd=root, capture_output=True, text=True, check=True, timeout=600)
    return run.stdout
