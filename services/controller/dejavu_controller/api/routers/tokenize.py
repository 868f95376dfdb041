"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's): the served model's tokenizer, keyed like the other
endpoints; tokenizing runs on a worker thread, bounded like a prompt."""

from __future__ import annotations

import anyio
from fastapi import APIRouter

from dejavu_controller.api.admission import check_model, check_prompt_chars, check_token_ids, encode_chat
from dejavu_controller.api.dependencies import GatewayDep
from dejavu_controller.api.schemas.tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeCompletionRequest,
    TokenizeRequest,
    TokenizeResponse,
)

router = APIRouter(tags=["tokenize"])


@router.post("/tokenize", response_model=TokenizeResponse)
async def tokenize(body: TokenizeRequest, gateway: GatewayDep) -> TokenizeResponse:
    """The token ids of a prompt (``prompt``) or of a conversation under the chat template (``messages``)."""
    if body.model is not None:
        check_model(gateway, body.model)
    tokenizer = gateway.tokenizer
    if isinstance(body, TokenizeCompletionRequest):
        check_prompt_chars(gateway, len(body.prompt), "prompt")
        ids = await anyio.to_thread.run_sync(tokenizer.encode, body.prompt, body.add_special_tokens)
    else:
        messages = [m.as_template_message() for m in body.messages]
        ids = await encode_chat(gateway, messages, body.add_generation_prompt)
    strs = [tokenizer.decode([t], skip_special_tokens=False) for t in ids] if body.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=gateway.max_context, tokens=ids, token_strs=strs)


@router.post("/detokenize", response_model=DetokenizeResponse)
async def detokenize(body: DetokenizeRequest, gateway: GatewayDep) -> DetokenizeResponse:
    """The text of token ids, special tokens included (as vLLM's: ``/tokenize`` of it gives them back)."""
    if body.model is not None:
        check_model(gateway, body.model)
    check_token_ids(gateway, body.tokens, "tokens")
    return DetokenizeResponse(prompt=await anyio.to_thread.run_sync(gateway.tokenizer.decode, body.tokens, False))
