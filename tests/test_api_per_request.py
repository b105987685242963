"""`kiln serve --per-request-sampling`: nothing sticks, every request starts from the model's
defaults (contract.md, "Sticky settings")."""

import pytest
from api_server import MODEL, KilnServer
from test_api_sampling import DEFAULTS, LOOSE, explicit_defaults, say


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with KilnServer(tmp_path_factory.mktemp("kiln-per-request"), "--per-request-sampling") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def test_nothing_sticks(client):
    loose = say(client, seed=5, **LOOSE)  # would store the loose settings without the flag
    say(client, max_tokens=1, temperature=0, presence_penalty=1.0,
        extra_body={"repeat_last_n": 0})
    unsent = say(client, seed=5)  # the model's defaults, not the values sent before
    assert unsent == say(client, seed=5, **explicit_defaults())
    assert unsent != loose


def test_models_still_shows_the_defaults(client):
    card = next(m for m in client.models.list().data if m.id == MODEL).model_dump()
    assert card["defaults"] == DEFAULTS[MODEL]
    assert card["loaded"] is True
