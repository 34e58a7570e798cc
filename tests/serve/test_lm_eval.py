"""lm-eval as a real client of `kvforge serve`: a 10-question multiple-choice task defined in local
files (no download) run with `lm_eval --model local-completions` against the served real SmolLM2
export gives the same answers and accuracy as scoring the task through `Generator.score` directly
(each choice's loglikelihood: the sum of its continuation tokens' log-probabilities after the
context, as lm-eval computes it; the prediction is the argmax)."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("lm_eval")
pytest.importorskip("transformers")  # lm-eval's huggingface tokenizer backend

from kvforge.runtime import Generator  # noqa: E402

QUESTIONS = [
    ("What is the capital of France?", ["Paris", "London", "Berlin", "Madrid"], 0),
    ("How many legs does a spider have?", ["eight", "six", "four", "two"], 0),
    ("What color is the sky on a clear day?", ["green", "blue", "red", "yellow"], 1),
    ("Which planet is known as the Red Planet?", ["Venus", "Jupiter", "Mars", "Saturn"], 2),
    ("What do bees make?", ["milk", "silk", "honey", "wool"], 2),
    ("What is 2 + 2?", ["3", "4", "5", "22"], 1),
    ("At how many degrees Celsius does water freeze?", ["100", "50", "0", "10"], 2),
    ("Which animal says moo?", ["cat", "dog", "cow", "duck"], 2),
    ("What is the largest ocean on Earth?", ["Atlantic", "Indian", "Arctic", "Pacific"], 3),
    ("In which season does snow usually fall?", ["summer", "winter", "spring", "autumn"], 1),
]
TASK = "kvforge_mc"


def _context(question: str) -> str:
    return f"Question: {question}\nAnswer:"


def _task_files(folder: Path) -> Path:
    data = folder / "mc.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    (folder / f"{TASK}.yaml").write_text(f"""task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
""")
    return folder


def _direct_scores(export: Path) -> list[list[float]]:
    """Each choice's loglikelihood through Generator.score, tokenized as lm-eval does (context and
    context + " " + choice, no special tokens; the continuation is what follows the context's ids)."""
    gen = Generator(export)
    assert gen.tokenizer is not None
    scores = []
    for question, choices, _ in QUESTIONS:
        context = gen.tokenizer.encode(_context(question), add_special_tokens=False)
        row = []
        for choice in choices:
            whole = gen.tokenizer.encode(f"{_context(question)} {choice}", add_special_tokens=False)
            assert whole[: len(context)] == context
            row.append(float(gen.score(whole)[len(context) - 1:].sum()))
        scores.append(row)
    return scores


def test_lm_eval_through_the_server_equals_scoring_directly(real, tmp_path) -> None:
    export = real["ort"]
    (tmp_path / "tasks").mkdir()
    tasks = _task_files(tmp_path / "tasks")
    server = subprocess.Popen([sys.executable, "-m", "kvforge.cli", "serve", str(export), "--port", "0",
                               "--max-batch", "2"], stderr=subprocess.PIPE, text=True)
    try:
        assert server.stderr is not None
        base = next((line.split(" on ")[1].split(" ")[0] for line in server.stderr if "serving" in line), None)
        assert base is not None, f"kvforge serve exited with {server.wait()}"
        env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "HF_HOME": str(tmp_path / "hf-home"), "TOKENIZERS_PARALLELISM": "false"}
        model_args = (f"base_url={base}/completions,model={export.name},tokenizer_backend=huggingface,"
                      f"tokenizer={real['hf']},num_concurrent=1,max_retries=1")
        lm_eval = subprocess.Popen([sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
                                    model_args, "--tasks", TASK, "--include_path", str(tasks), "--batch_size", "4",
                                    "--output_path", str(tmp_path / "out"), "--log_samples"],
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        direct = _direct_scores(export)  # meanwhile (lm-eval spends its first seconds indexing its own tasks)
        log, _ = lm_eval.communicate(timeout=600)
        assert lm_eval.returncode == 0, log[-3000:]
    finally:
        server.terminate()
        server.wait(timeout=30)
    out = tmp_path / "out"
    results = json.loads(Path(glob.glob(f"{out}/**/results_*.json", recursive=True)[0]).read_text())
    served_acc = results["results"][TASK]["acc,none"]
    samples = Path(glob.glob(f"{out}/**/samples_{TASK}_*.jsonl", recursive=True)[0]).read_text().splitlines()
    served = {s["doc_id"]: [float(r[0][0]) for r in s["resps"]] for s in map(json.loads, samples)}

    np.testing.assert_allclose([served[i] for i in range(len(QUESTIONS))], direct, atol=1e-4)
    direct_acc = float(np.mean([np.argmax(row) == gold for row, (_, _, gold) in zip(direct, QUESTIONS, strict=True)]))
    print(f"lm-eval accuracy through kvforge serve: {served_acc:.2f}; Generator.score directly: {direct_acc:.2f}")
    assert served_acc == direct_acc
