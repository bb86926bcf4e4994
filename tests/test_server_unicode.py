"""Non-ASCII streaming through the OpenAI server: multi-byte UTF-8 characters
split over byte-level tokens must reach the client whole.

The server runs the cycle checkpoint of tests/text_models.py, whose greedy
output repeats "é中😀\\n". Oracle: the tokenizer's decode of the output ids
(the non-streamed answer's token count pins how many there were)."""
import openai
import pytest
from transformers import AutoTokenizer

from server_utils import SERVED_NAME, Server
from text_models import write_cycle_model

TEXT = "é中😀\n"
PROMPT = "# " + TEXT


@pytest.fixture(scope="module")
def cycle_server(tmp_path_factory):
    path = tmp_path_factory.mktemp("cycle_model")
    cycle = write_cycle_model(path, TEXT)
    server = Server(model=str(path))
    yield server, cycle, AutoTokenizer.from_pretrained(str(path))
    server.stop()


def test_streamed_multibyte_characters_reach_the_client_whole(cycle_server):
    server, cycle, tok = cycle_server
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    n = 2 * len(cycle)
    kw = dict(model=SERVED_NAME, prompt=PROMPT, max_tokens=n, temperature=0.0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw)
    assert whole.usage.completion_tokens == n, "set-up: the request must run to max_tokens"
    full = tok.decode(cycle * 2)
    deltas = [c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices]
    bad = [d for d in deltas if "\ufffd" in d]
    assert not bad, (f"streamed chunks {bad} hold U+FFFD: the server sent text for an incomplete "
                     "multi-byte UTF-8 character instead of holding it back until its last byte")
    assert "".join(deltas) == full, f"streamed chunks {deltas} do not concatenate to the full decode {full!r}"
    assert len(deltas) >= 4, "a 20-token stream should arrive in several chunks"
    assert whole.choices[0].text == full, \
        f"non-streamed text {whole.choices[0].text!r} differs from the full decode {full!r} of the output ids"
