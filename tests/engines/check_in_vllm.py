"""Run by a vLLM environment's python (not depctl's): check exported settings against vLLM's and Ray's own schemas.

    python check_in_vllm.py argv '["vllm", "serve", MODEL, ...]' [--build]
    python check_in_vllm.py kwargs '{"model": ..., "engine_kwargs": {...}}' [--build]
    python check_in_vllm.py ray '{...one llm_config...}'

Prints one JSON object with what vLLM made of it; exits non-zero (vLLM's own error on stderr) when vLLM refuses.
``--build`` goes on to build the engine config (SpeculativeConfig included), which reads the model's config.json.
"""

import json
import sys


def engine_args_from_argv(argv):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    assert argv[:2] == ["vllm", "serve"], argv
    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    return AsyncEngineArgs.from_cli_args(parser.parse_args(["--model", argv[2], *argv[3:]]))


def describe(engine_args, build):
    out = {
        "model": engine_args.model,
        "dtype": str(engine_args.dtype),
        "max_num_seqs": engine_args.max_num_seqs,
        "max_model_len": engine_args.max_model_len,
        "tensor_parallel_size": engine_args.tensor_parallel_size,
        "pipeline_parallel_size": engine_args.pipeline_parallel_size,
        "distributed_executor_backend": engine_args.distributed_executor_backend,
        "speculative_config": engine_args.speculative_config,
        "enforce_eager": engine_args.enforce_eager,
    }
    if build:
        config = engine_args.create_engine_config()
        spec = config.speculative_config
        out["built"] = {
            "method": spec.method if spec else None,
            "num_speculative_tokens": spec.num_speculative_tokens if spec else None,
            "prompt_lookup_min": getattr(spec, "prompt_lookup_min", None) if spec else None,
            "prompt_lookup_max": getattr(spec, "prompt_lookup_max", None) if spec else None,
            "draft_model": spec.draft_model_config.model if spec and spec.draft_model_config else None,
            "max_model_len": config.model_config.max_model_len,
            "max_num_seqs": config.scheduler_config.max_num_seqs,
        }
    return out


def main():
    kind, data = sys.argv[1], json.loads(sys.argv[2])
    build = "--build" in sys.argv[3:]
    if kind == "argv":
        print(json.dumps(describe(engine_args_from_argv(data), build)))
    elif kind == "kwargs":
        from vllm.engine.arg_utils import AsyncEngineArgs

        print(json.dumps(describe(AsyncEngineArgs(model=data["model"], **data["engine_kwargs"]), build)))
    elif kind == "ray":
        from ray.serve.llm import LLMConfig

        config = LLMConfig(**data)
        print(
            json.dumps(
                {
                    "model_id": config.model_id,
                    "engine_kwargs": config.engine_kwargs,
                    "autoscaling": config.deployment_config.get("autoscaling_config"),
                }
            )
        )
    else:
        sys.exit(f"unknown check {kind!r}")


if __name__ == "__main__":
    main()
