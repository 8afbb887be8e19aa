"""A stand-in for vLLM's OpenAI server, for the daemon's supervision and proxy tests (the real one: tests/engines).

Speaks just enough of it: /health, /metrics with vllm:spec_decode_* counters, chat and text completions (streamed
or not) with vLLM's extra fields, the API key from VLLM_API_KEY. FAKE_VLLM_FAIL=1: fails at start-up as a bad model
would. FAKE_VLLM_RECORD=FILE: each request body is appended there as a JSON line. max_tokens=13: a 400 in vLLM's shape;
max_tokens=7: three chunks that carry seven tokens.
"""

import argparse
import json
import os
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

COUNTS = {"requests": 0}


def metrics_text(name: str) -> str:
    n = COUNTS["requests"]
    lines = []
    for metric, value in (("vllm:spec_decode_num_drafts_total", 2 * n), ("vllm:spec_decode_num_draft_tokens_total", 8 * n),
                          ("vllm:spec_decode_num_accepted_tokens_total", 5 * n), ("vllm:request_success_total", n),
                          ("vllm:generation_tokens_total", 3 * n)):
        lines += [f"# TYPE {metric[:-6]} counter", f'{metric}{{engine="0",model_name="{name}"}} {float(value)}']
    lines += ["# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter"]
    for pos, value in enumerate((2, 2, 1, 0)):
        lines.append(f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="{name}",position="{pos}"}} {float(value * n)}')
    lines += ["# TYPE vllm:num_requests_running gauge", f'vllm:num_requests_running{{engine="0",model_name="{name}"}} 0.0']
    return "\n".join(lines) + "\n"


def make_handler(args):
    key = os.environ.get("VLLM_API_KEY")

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _send(self, status, body, ctype="application/json"):
            data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/health":
                return self._send(200, "", "text/plain")
            if self.path == "/metrics":
                return self._send(200, metrics_text(args.served_model_name), "text/plain")
            self._send(404, {"error": {"message": "no such route", "type": "NotFoundError", "param": None, "code": 404}})

        def do_POST(self):
            if key and self.headers.get("Authorization") != f"Bearer {key}":
                return self._send(401, {"error": {"message": "Unauthorized", "type": "Unauthorized", "param": None, "code": 401}})
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if os.environ.get("FAKE_VLLM_RECORD"):
                with open(os.environ["FAKE_VLLM_RECORD"], "a") as fh:
                    fh.write(json.dumps(body) + "\n")
            if body.get("max_tokens") == 13:
                return self._send(400, {"error": {"message": "fake refusal of max_tokens=13", "type": "BadRequestError",
                                                  "param": "max_tokens", "code": 400}})
            COUNTS["requests"] += 1
            chat = self.path == "/v1/chat/completions"
            words = ["hello", " from", " vllm"]
            # max_tokens=7: as under speculation, a chunk carries several tokens (3 chunks, 7 tokens)
            done = 7 if body.get("max_tokens") == 7 else 3
            # vLLM says how many prompt tokens its prefix cache held only when started with --enable-prompt-tokens-details
            details = {"cached_tokens": 3} if "--enable-prompt-tokens-details" in sys.argv else None
            usage = {"prompt_tokens": 5, "completion_tokens": done, "total_tokens": 5 + done, "prompt_tokens_details": details}
            head = {"id": "chatcmpl-fromvllm" if chat else "cmpl-fromvllm", "created": 1, "model": body["model"],
                    "system_fingerprint": None, "prompt_token_ids": None}
            if not body.get("stream"):
                choice = {"index": 0, "finish_reason": "length", "stop_reason": None, "logprobs": None, "token_ids": None}
                if chat:
                    choice["message"] = {"role": "assistant", "content": "".join(words), "reasoning": None, "tool_calls": []}
                else:
                    choice["text"] = "".join(words)
                return self._send(200, {**head, "object": "chat.completion" if chat else "text_completion",
                                        "choices": [choice], "usage": usage})
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            obj = "chat.completion.chunk" if chat else "text_completion"
            include_usage = (body.get("stream_options") or {}).get("include_usage")
            for i, word in enumerate(words):
                finish = "length" if i == len(words) - 1 else None
                choice = {"index": 0, "finish_reason": finish, "logprobs": None, "stop_reason": None}
                if chat:
                    choice["delta"] = {"content": word, **({"role": "assistant"} if i == 0 else {}), "reasoning": None}
                else:
                    choice["text"] = word
                chunk = {**head, "object": obj, "choices": [choice], **({"usage": None} if include_usage else {})}
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.flush()
            if include_usage:
                self.wfile.write(f"data: {json.dumps({**head, 'object': obj, 'choices': [], 'usage': usage})}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()

    return Handler


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int)
    parser.add_argument("--served-model-name")
    args, _ = parser.parse_known_args()
    print(f"INFO fake vLLM: argv {json.dumps(sys.argv[1:])}", flush=True)
    if os.environ.get("FAKE_VLLM_FAIL"):
        print("ValueError: fake start-up failure (the model cannot be served)", flush=True)
        sys.exit(1)
    time.sleep(0.3)
    for step in range(int(float(os.environ.get("FAKE_VLLM_SLOW_START", "0")) / 0.2)):  # a load that logs as it goes
        print(f"INFO: loading weights, step {step}", flush=True)
        time.sleep(0.2)
    server = ThreadingHTTPServer((args.host, args.port), make_handler(args))
    print("INFO: Application startup complete.", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
