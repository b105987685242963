"""Two architectures behind one server: a request naming the other model loads it, and the
switch restores that model's default sampling settings (contract.md, "Sticky settings")."""

import pytest
from api_server import MODEL, KilnServer
from test_api_sampling import DEFAULTS, LOOSE, PROMPT

GEMMA = "gemma3:270m"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with KilnServer(tmp_path_factory.mktemp("kiln-models")) as s:
        yield s


def _say(client, model, **kw) -> str:
    r = client.chat.completions.create(model=model, max_tokens=6,
                                       messages=[{"role": "user", "content": PROMPT}], **kw)
    return r.choices[0].message.content


def _explicit(model) -> dict:
    d = dict(DEFAULTS[model])
    return dict(temperature=d.pop("temperature"), top_p=d.pop("top_p"),
                presence_penalty=d.pop("presence_penalty"),
                frequency_penalty=d.pop("frequency_penalty"), extra_body=d)


def test_a_request_for_the_other_model_switches_and_resets_settings(server):
    client = server.client(timeout=600)
    _say(client, MODEL, **LOOSE)  # loose settings now stick on smollm2
    loose = _say(client, MODEL, seed=3)
    reply = client.chat.completions.create(
        model=GEMMA, max_tokens=8, messages=[{"role": "user", "content": "Say hello."}])
    assert reply.model == GEMMA and reply.choices[0].message.content
    cards = {m.id: m.model_dump() for m in client.models.list().data}
    assert cards[GEMMA]["loaded"] and not cards[MODEL]["loaded"]
    assert _say(client, GEMMA, seed=3) == _say(client, GEMMA, seed=3, **_explicit(GEMMA))
    # Back on smollm2, its defaults are in force again, not the loose settings.
    again = _say(client, MODEL, seed=3)
    assert again == _say(client, MODEL, seed=3, **_explicit(MODEL))
    assert again != loose
