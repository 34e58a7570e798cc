"""The Ray Serve deployment (kvforge/serve/ray_serve.py): two local replicas answer through HTTP with the
same greedy text as Generator.generate."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from serving import free_port

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")

from kvforge.core.errors import InputError  # noqa: E402
from kvforge.runtime import Generator  # noqa: E402
from kvforge.serve.ray_serve import deployment  # noqa: E402


@pytest.mark.slow
def test_two_local_replicas_answer_through_http(exported) -> None:
    folder = exported("llama-tiny", "ort")
    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, ignore_reinit_error=True, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(deployment(folder, replicas=2, threads=1, max_batch=2, max_seq_len=128, model_name="tiny"),
                  route_prefix="/")
        states = serve.status().applications["default"].deployments["kvforge"].replica_states
        assert states.get("RUNNING") == 2, states
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
        reference = Generator(folder)
        prompts = [f"prompt number {i}" for i in range(8)]
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda p: client.completions.create(model="tiny", prompt=p, max_tokens=8,
                                                                        temperature=0).choices[0].text, prompts))
        for prompt, answer in zip(prompts, answers, strict=True):
            assert answer == reference.generate(prompt, max_new_tokens=8, greedy=True).text[0]
    finally:
        serve.shutdown()
        ray.shutdown()


def test_deployment_refuses_what_is_not_an_export(tmp_path) -> None:
    with pytest.raises(InputError, match="is not a kvforge export folder"):
        deployment(tmp_path)
    with pytest.raises(InputError, match="replicas must be a positive integer"):
        deployment(tmp_path, replicas=0)
