"""What a user gets from ``pip install specbatch`` on a CPU machine: the package imports and
generates (speculation included) and runs batch files with every optional package missing, and
``serve`` says which extra it needs instead of failing with a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

OPTIONAL = (
    "triton",
    "flash_attn",
    "xformers",
    "fastapi",
    "uvicorn",
    "uvloop",
    "starlette",
    "prometheus_client",
    "scipy",
    "transformers",
    "accelerate",
    "httpx",
    "openai",
    "ray",
)

SCRIPT = """
import sys
for name in {optional!r}:
    sys.modules[name] = None  # as if not installed: importing it raises ImportError
from specbatch import LLM, SamplingParams
from specbatch.cli import main

model = {model!r}
params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
for speculative in (None, {{"method": "ngram"}}, {{"method": "hybrid", "model": model}}):
    llm = LLM(model, num_kv_blocks=32, max_model_len=128, speculative_config=speculative)
    out = llm.generate([[5, 6, 7, 5, 6, 7]], params, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 6, out
assert main(["generate", "hello", "--model", model, "--max-tokens", "3", "--quiet"]) == 0
assert main(["serve", "--model", model]) == 2
# run-batch is part of the base install (pydantic checks its bodies; no server extra)
import json, pathlib, tempfile
folder = pathlib.Path(tempfile.mkdtemp())
line = {{"custom_id": "a", "method": "POST", "url": "/v1/completions",
         "body": {{"prompt": "hi", "max_tokens": 3}}}}
(folder / "in.jsonl").write_text(json.dumps(line) + "\\n")
batch = ["run-batch", "-i", str(folder / "in.jsonl"), "-o", str(folder / "out.jsonl"),
         "--model", model, "--num-kv-blocks", "32", "--max-model-len", "128", "--no-progress"]
assert main(batch) == 0
result = json.loads((folder / "out.jsonl").read_text())
assert result["response"]["status_code"] == 200, result
assert main([*batch, "--ray"]) == 2  # says which extra it needs
print("ok")
"""


def test_cpu_generation_needs_no_optional_package(tiny_model_dir: Path) -> None:
    script = SCRIPT.format(optional=OPTIONAL, model=str(tiny_model_dir))
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")
    assert "specbatch serve needs fastapi, uvicorn, prometheus_client" in result.stderr
    assert "pip install 'specbatch[server]'" in result.stderr
    assert "run-batch --ray needs Ray: pip install 'specbatch[ray]'" in result.stderr
