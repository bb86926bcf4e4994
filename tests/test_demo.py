"""`make demo` (mini_vllm.demo) on both of the course's demo models, briefly: every request
finishes with its tokens, and a model name it does not serve is refused naming the choices."""
import pytest

from mini_vllm import demo


@pytest.mark.parametrize("model, served", [("tiny-py-target", "qwen3, no experts"),
                                           ("tiny-py-moe", "qwen3_moe, 8 experts")])
def test_demo_serves_every_request(model, served, capsys):
    stats = demo.main(num_requests=6, max_tokens=6, model=model)
    out = capsys.readouterr().out
    assert f"mini-vLLM demo: {model}" in out, f"the demo did not say which model it serves: {out[:200]!r}"
    line = next(ln for ln in out.splitlines() if ln.startswith("model served"))
    assert line.split(None, 2)[2].strip() == served, f"{model}: the engine loaded {line!r}, not {served!r}"
    assert stats["requests_finished"] == 6, f"{model}: {stats['requests_finished']} of 6 requests finished"


def test_demo_refuses_an_unknown_model():
    with pytest.raises(ValueError, match="model must be one of"):
        demo.main(num_requests=1, max_tokens=1, model="tiny-py-draft")
