"""The official `openai` SDK as a client of the router on simulated engines: sync and
async clients, streaming, n > 1, logprobs, batches, embeddings, request ids, and vLLM's
errors as the SDK's exceptions."""

from __future__ import annotations

import asyncio

import openai
import pytest

from support.cluster import MODEL, Cluster, MakeCluster, long_prompt


@pytest.fixture
async def cluster(make_cluster: MakeCluster) -> Cluster:
    return await make_cluster(decoders=2)


def _async_client(c: Cluster) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=c.url + "/v1", api_key="unused", max_retries=0)


async def test_async_completions_chat_and_streams(cluster: Cluster) -> None:
    async with _async_client(cluster) as client:
        out = await client.completions.create(model=MODEL, prompt=long_prompt("sdk", 60), max_tokens=5, logprobs=2)
        (choice,) = out.choices
        assert out.usage is not None
        assert out.usage.completion_tokens == 5
        assert choice.finish_reason == "length"
        assert choice.logprobs is not None
        assert choice.logprobs.tokens is not None
        assert choice.logprobs.top_logprobs is not None
        assert len(choice.logprobs.tokens) == 5
        assert all(len(t) >= 1 for t in choice.logprobs.top_logprobs)

        chat = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=4, logprobs=True, top_logprobs=2
        )
        assert chat.choices[0].message.role == "assistant"
        assert chat.usage is not None
        assert chat.usage.completion_tokens == 4
        chat_logprobs = chat.choices[0].logprobs
        assert chat_logprobs is not None
        assert chat_logprobs.content is not None
        assert len(chat_logprobs.content) == 4

        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, usage, ids = "", None, set()
        async for chunk in stream:
            ids.add(chunk.id)
            for ch in chunk.choices:
                text += ch.delta.content or ""
            usage = chunk.usage or usage
        assert len(ids) == 1
        assert usage is not None
        assert usage.completion_tokens == 6
        # The simulator samples from the prompt alone: the stream's first 4 tokens are the
        # unary answer's.
        content = chat.choices[0].message.content
        assert content is not None
        assert len(text) > len(content)
        assert text.startswith(content)


async def test_async_n_batches_and_embeddings(cluster: Cluster) -> None:
    async with _async_client(cluster) as client:
        out = await client.completions.create(model=MODEL, prompt="one two", n=3, max_tokens=3)
        assert [c.index for c in out.choices] == [0, 1, 2]
        assert out.usage is not None
        assert out.usage.completion_tokens == 9
        batch = await client.completions.create(model=MODEL, prompt=["one two", "three four"], n=2, max_tokens=2)
        assert [c.index for c in batch.choices] == [0, 1, 2, 3]
        chat = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=3
        )
        assert [c.index for c in chat.choices] == [0, 1]
        pieces: dict[int, str] = {}
        stream = await client.completions.create(model=MODEL, prompt="one two", n=2, max_tokens=4, stream=True)
        async for chunk in stream:
            for ch in chunk.choices:
                pieces[ch.index] = pieces.get(ch.index, "") + ch.text
        assert sorted(pieces) == [0, 1]
        emb = await client.embeddings.create(model=MODEL, input=["a", "b"])
        assert len(emb.data) == 2
        assert len(emb.data[0].embedding) > 0


async def test_request_id_and_errors(cluster: Cluster) -> None:
    async with _async_client(cluster) as client:
        raw = await client.completions.with_raw_response.create(
            model=MODEL, prompt="hi", max_tokens=2, extra_headers={"X-Request-Id": "sdk-req-1"}
        )
        assert raw.headers["X-Request-Id"] == "sdk-req-1"
        assert raw.parse().id == "cmpl-sdk-req-1"
        with pytest.raises(openai.NotFoundError) as e:
            await client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
        assert "no-such-model" in str(e.value)
        with pytest.raises(openai.BadRequestError) as bad:
            await client.completions.create(model=MODEL, prompt="hi", max_tokens=-1)
        assert isinstance(bad.value.body, dict)
        assert bad.value.body["param"] == "max_tokens"
        # The engine's own answer to a request it refuses (the simulator has no tools),
        # as the SDK's exception.
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "weather?"}],
                max_tokens=2,
                tools=[
                    {
                        "type": "function",
                        "function": {
                            "name": "get_weather",
                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
                        },
                    }
                ],
            )
        assert "tools" in str(refused.value)


async def test_sync_client(cluster: Cluster) -> None:
    def run() -> tuple[str, int, list[int]]:
        with openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0) as client:
            out = client.completions.create(model=MODEL, prompt="sync call", max_tokens=3)
            streamed = "".join(
                ch.choices[0].text
                for ch in client.completions.create(model=MODEL, prompt="sync call", max_tokens=3, stream=True)
                if ch.choices
            )
            n = client.completions.create(model=MODEL, prompt="sync call", max_tokens=2, n=2)
            assert out.usage is not None
            return out.choices[0].text + "|" + streamed, out.usage.completion_tokens, [c.index for c in n.choices]

    # The router serves on this test's loop: the blocking client runs in a thread.
    texts, tokens, indices = await asyncio.to_thread(run)
    unary, streamed = texts.split("|")
    assert unary == streamed
    assert tokens == 3
    assert indices == [0, 1]
