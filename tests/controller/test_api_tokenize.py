"""``/tokenize`` and ``/detokenize`` (vLLM's shapes), keyed like every other endpoint."""

from __future__ import annotations

from fastapi.testclient import TestClient

from dejavu_common.tokenizer import Tokenizer

from .conftest import MODEL


def test_tokenize_a_prompt_and_back(client: TestClient, tokenizer: Tokenizer):
    response = client.post(
        "/tokenize", json={"model": MODEL, "prompt": "The quick brown fox", "return_token_strs": True}
    )
    assert response.status_code == 200, response.text
    body = response.json()
    ids = tokenizer.encode("The quick brown fox")
    assert body == {
        "count": len(ids),
        "max_model_len": 256,
        "tokens": ids,
        "token_strs": [tokenizer.decode([t], skip_special_tokens=False) for t in ids],
    }
    back = client.post("/detokenize", json={"model": MODEL, "tokens": ids})
    assert back.status_code == 200 and back.json() == {"prompt": "The quick brown fox"}
    assert client.post("/tokenize", json={"prompt": "Hi"}).json()["token_strs"] is None  # model is optional


def test_tokenize_a_conversation_as_chat_does(client: TestClient, tokenizer: Tokenizer):
    messages = [{"role": "user", "content": "Say hello"}]
    body = client.post("/tokenize", json={"messages": messages}).json()
    assert body["tokens"] == tokenizer.apply_chat_template(messages)
    bare = client.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert bare["tokens"] == tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    assert bare["count"] < body["count"]
    special = client.post("/detokenize", json={"tokens": body["tokens"]}).json()["prompt"]
    assert special == tokenizer.render_chat(messages)  # special tokens kept, as vLLM's


def test_tokenize_errors(client: TestClient):
    cases = [
        ("/tokenize", {"model": "gpt-4", "prompt": "Hi"}, 404, "model"),
        ("/tokenize", {"prompt": 5}, 400, None),
        ("/tokenize", {"text": "Hi"}, 400, None),
        ("/tokenize", {"messages": []}, 400, None),
        ("/detokenize", {"tokens": [1, 10**6]}, 400, "tokens"),
        ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ]
    for path, payload, status, param in cases:
        response = client.post(path, json=payload)
        assert response.status_code == status, (payload, response.text)
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        if param is not None:
            assert error["param"] == param


def test_tokenize_needs_the_api_key(client: TestClient):
    for path, payload in (("/tokenize", {"prompt": "Hi"}), ("/detokenize", {"tokens": [1]})):
        response = client.post(path, json=payload, headers={"Authorization": "Bearer sk-wrong"})
        assert response.status_code == 401
