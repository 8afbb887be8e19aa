"""depctl in one run: deploy the default model twice (n-gram speculation on, and off), send the same request to
both with the OpenAI SDK, print the answer, the deployment's state and the speedup.

    scripts/quickstart.sh                      # sets up, then runs this
    .venv/bin/python examples/quickstart.py    # once set up

Every step is a plain `depctl` command (printed as it runs), so you can repeat any of them by hand.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import time

from openai import OpenAI

from depctl.client import daemon_info

MODEL = "smollm2-135m-instruct"
SPEC = "quickstart"
PLAIN = "quickstart-plain"
SPEC_FLAGS = ["--ngram-speculation-length=3", "--draft-token-count=8"]

# An input-grounded request, the case prompt lookup is for: most of the answer is copied from the prompt.
PASSAGE = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is named after "
    "the engineer Gustave Eiffel, whose company designed and built the tower from 1887 to 1889. Locally nicknamed "
    '"La dame de fer" (French for "Iron Lady"), it was constructed as the centrepiece of the 1889 World\'s Fair, '
    "and to crown the centennial anniversary of the French Revolution."
)
MESSAGES = [{"role": "user", "content": f"Repeat this passage word for word:\n\n{PASSAGE}"}]


def depctl(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    print(f"$ depctl {shlex.join(args)}", file=sys.stderr)
    return subprocess.run(
        [sys.executable, "-m", "depctl", *args],
        check=check,
        text=True,
        stdout=subprocess.PIPE if "-o" in args else None,
    )


def ensure(dep_id: str, flags: list[str]) -> None:
    exists = (
        subprocess.run(
            [sys.executable, "-m", "depctl", "deployment", "get", dep_id, "-o", "json"], capture_output=True
        ).returncode
        == 0
    )
    if exists:
        depctl("deployment", "update", dep_id, *(flags or ["--disable-speculative-decoding"]), "-o", "json")
    else:
        depctl("deployment", "create", MODEL, "--deployment-id", dep_id, *flags, "-o", "json")


def timed(client: OpenAI, dep_id: str) -> tuple[str, float, dict]:
    t0 = time.perf_counter()
    r = client.chat.completions.create(model=dep_id, messages=MESSAGES, max_tokens=160, temperature=0)
    return r.choices[0].message.content, time.perf_counter() - t0, r.usage


def main() -> int:
    depctl("daemon", "start")
    ensure(SPEC, SPEC_FLAGS)
    ensure(PLAIN, [])
    client = OpenAI(base_url=daemon_info().url + "/v1", api_key="not-needed")

    print("\nasking both deployments the same question, alternating, twice each", file=sys.stderr)
    for dep in (SPEC, PLAIN):  # warm-up: first requests pay for lazy initialisation
        client.chat.completions.create(model=dep, messages=MESSAGES[:1], max_tokens=8, temperature=0)
    runs = {SPEC: [], PLAIN: []}
    for _ in range(2):  # alternate, and keep the best of two: these machines are noisy
        for dep in (PLAIN, SPEC):
            runs[dep].append(timed(client, dep))
            print(f"  {dep}: {runs[dep][-1][2].completion_tokens} tokens in {runs[dep][-1][1]:.2f}s", file=sys.stderr)
    (text, t_spec, usage) = min(runs[SPEC], key=lambda r: r[1])
    (plain_text, t_plain, plain_usage) = min(runs[PLAIN], key=lambda r: r[1])

    print("\n--- answer (n-gram speculation) ---")
    print(text)
    print("\n--- deployment ---")
    depctl("deployment", "get", SPEC)
    spec = usage.model_extra.get("speculation") or {}
    n = usage.completion_tokens
    print("\n--- speedup ---")
    print(f"plain decoding       {plain_usage.completion_tokens / t_plain:6.1f} tok/s  ({t_plain:.2f}s)")
    print(
        f"n-gram speculation   {n / t_spec:6.1f} tok/s  ({t_spec:.2f}s)  "
        f"acceptance {spec.get('acceptance_rate') or 0:.0%}"
    )
    print(
        f"speedup              {t_plain / t_spec * n / plain_usage.completion_tokens:6.2f}x   "
        f"identical output: {'yes' if text == plain_text else 'NO'}"
    )
    return 0 if text == plain_text else 1


if __name__ == "__main__":
    sys.exit(main())
