"""`kiln serve --speculative ngram` over HTTP: a streamed chunk carries every token of its step,
usage counts the drafted tokens kept and rejected, /metrics counts them, and the routes of
every dialect answer as on a server without drafting would, greedy."""

import httpx
import pytest
from api_server import MODEL, KilnServer
from prometheus_client.parser import text_string_to_metric_families
from route_calls import GREEDY, OLLAMA_GREEDY

CODE = '''def area(width, height):
    """The area of a rectangle."""
    return width * height


def perimeter(width, height):
    """The perimeter of a rectangle."""
    return 2 * (width + height)'''
# The model said it once already: asked again, it copies, and prompt lookup drafts it.
AGAIN = [{"role": "user", "content": f"Repeat this code exactly:\n{CODE}"},
         {"role": "assistant", "content": CODE},
         {"role": "user", "content": "Again, the same code."}]
# The same, then text of its own: sampled choices that copy, then part ways (drafted tokens
# the model agrees with skip the sampler, so choices that only copy are all alike).
THEN_SAY = AGAIN[:-1] + [{"role": "user",
                          "content": "Again, the same code, then a sentence on what it is for."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with KilnServer(tmp_path_factory.mktemp("kiln"), "--speculative", "ngram",
                    "--ctx-len", "1024", "--kv-cache-tokens", "8192") as s:
        yield s


def drafted_counters(server) -> tuple[float, float]:
    samples = {s.name: s.value for f in text_string_to_metric_families(
        httpx.get(f"{server.url}/metrics").text) for s in f.samples}
    return (samples["kiln:spec_decode_num_draft_tokens_total"],
            samples["kiln:spec_decode_num_accepted_tokens_total"])


def test_a_stream_carries_each_steps_tokens_and_usage_counts_the_drafts(server):
    client = server.client()
    before = drafted_counters(server)
    whole = client.chat.completions.create(model=MODEL, messages=AGAIN, max_tokens=60,
                                           extra_body=GREEDY)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=AGAIN, max_tokens=60, extra_body=GREEDY, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content and CODE[:40] in text
    details = whole.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 10
    assert chunks[-1].usage.completion_tokens_details == details
    pieces = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(pieces) < whole.usage.completion_tokens  # several tokens in some chunks
    drafted, kept = (b - a for a, b in zip(before, drafted_counters(server)))
    assert kept == 2 * details.accepted_prediction_tokens
    assert drafted == 2 * (details.accepted_prediction_tokens
                           + details.rejected_prediction_tokens)


def test_every_dialect_answers_with_drafting(server):
    client = server.client()
    chat = client.chat.completions.create(model=MODEL, messages=AGAIN, max_tokens=40,
                                          extra_body=GREEDY).choices[0].message.content
    response = client.responses.create(model=MODEL, input=AGAIN, max_output_tokens=40,
                                       extra_body=GREEDY)
    assert response.output_text == chat
    ollama = httpx.post(f"{server.url}/api/chat", json={
        "model": MODEL, "messages": AGAIN, "stream": False,
        "options": {**OLLAMA_GREEDY, "num_predict": 40}}, timeout=120).json()
    assert ollama["message"]["content"] == chat


def test_seeded_choices_with_logprobs_repeat(server):
    client = server.client()
    seeded = {**GREEDY, "temperature": 0.8, "presence_penalty": 0.5}

    def ask():
        return client.chat.completions.create(model=MODEL, messages=THEN_SAY, max_tokens=40,
                                              n=2, seed=7, logprobs=True, top_logprobs=2,
                                              extra_body=seeded)

    first, again = ask(), ask()
    for a, b in zip(first.choices, again.choices):
        assert a.message.content == b.message.content
        assert [t.logprob for t in a.logprobs.content] == [t.logprob for t in b.logprobs.content]
    assert first.choices[0].message.content != first.choices[1].message.content
    assert len(first.choices[0].logprobs.content) > 0
    assert first.usage.completion_tokens_details.accepted_prediction_tokens > 0
