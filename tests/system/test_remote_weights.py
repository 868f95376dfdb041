"""A deployment whose workers fetch their stages' shares of the model from a weight source (``model.source_url``)
instead of reading it from their own disk: the same greedy outputs as the engine run from the folder itself."""

from __future__ import annotations

import pytest
import redis
from engine.weight_sources import TOKEN, serving
from openai import OpenAI
from pydantic import SecretStr

from dejavu_common import keys
from dejavu_common.messages import Topology

from .cluster import cluster_settings, logs, running
from .reference import Reference

pytestmark = [pytest.mark.e2e, pytest.mark.model, pytest.mark.slow]

PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,"]


def test_prompt_and_token_workers_serve_the_shares_they_fetched(redis_url, model, tmp_path) -> None:
    reference = Reference(model)
    with serving(model) as (url, app):
        settings = cluster_settings(redis_url, model, prompt_depth=2, token_depth=2)
        source = {"source_url": url, "source_token": SecretStr(TOKEN), "cache_dir": tmp_path}
        settings = settings.model_copy(update={"model": settings.model.model_copy(update=source)})
        with running(settings) as launcher:
            client = OpenAI(base_url=launcher.api_url + "/v1", api_key="unused", timeout=180, max_retries=0)
            for prompt in PROMPTS:
                r = client.completions.create(model=settings.model.name, prompt=prompt, max_tokens=8, temperature=0)
                assert r.choices[0].text == reference.text(prompt, 8), logs(launcher)
            control = redis.Redis.from_url(redis_url)
            topology = Topology.decode(control.get(keys.TOPOLOGY))
            control.close()
        sent = app.state.bytes_sent
    assignments = [a.layers for a in (*topology.prompt_stages, *topology.token_stages)]
    shares = {tuple(int(n) for n in p.name.split("-")[1:3]): p for p in (tmp_path / "remote").iterdir() if p.is_dir()}
    assert shares.keys() == set(assignments)  # every worker loaded its share; workers of one range share one folder
    weights = (model / "model.safetensors").stat().st_size
    share_bytes = {layers: (p / "model.safetensors").stat().st_size for layers, p in shares.items()}
    assert all(size < 0.7 * weights for size in share_bytes.values())
    # each share fetched once (the workers of one range on one host take turns): its tensors, the source's header
    # and the small files (config, tokenizer)
    small = sum(f.stat().st_size for p in shares.values() for f in p.iterdir() if f.suffix != ".safetensors")
    assert sum(share_bytes.values()) <= sent < sum(share_bytes.values()) + small + len(shares) * (256 << 10)
