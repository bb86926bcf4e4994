"""lm-evaluation-harness against the server: log-likelihood scoring through
`echo` + `logprobs` (the engine's prompt logprobs).

Oracle: Hugging Face transformers in fp32 (a forward pass's log-softmax, and
lm-eval's own `hf` backend). The first test sends lm-eval's exact request
shapes by hand (token-id prompts in a batch, `echo`, `logprobs: 1`,
`max_tokens: 1` or 0) and parses them as lm-eval does; the second runs lm-eval
itself, `local-completions` against the server and `hf` on the checkpoint, on
a small multiple-choice task and a rolling perplexity task built here from
local data, and compares every per-sample score.
"""
import json

import httpx
import pytest
import torch

from engine_utils import target_path
from mini_vllm.course.tiny_models import load_tiny_model, load_tiny_tokenizer
from server_utils import API_KEY, SERVED_NAME, api_server  # noqa: F401 - a fixture

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHOICE_DOCS = [
    ("def add(a, b):\n    return", [" a + b", " a - b", " None", " print(a)"], 0),
    ("import os\nimport", [" sys", " banana", " 42", " ("], 0),
    ("for i in range(10):\n   ", [" print(i)", " return", " import", " class"], 0),
    ("class Stack:\n    def __init__(self):\n        self.items =", [" []", " {}", " 0", " None"], 0),
    ("if __name__ ==", [' "__main__":', " 3:", " None:", " True:"], 0),
    ("with open(path) as f:\n    data =", [" f.read()", " f.close()", " path", " 1"], 0),
]
ROLLING_DOCS = [
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "import sys\n\n\ndef main(argv=None):\n    args = argv or sys.argv[1:]\n    for a in args:\n"
    "        print(a.upper())\n    return 0\n",
]


@pytest.fixture(scope="module")
def hf():
    return load_tiny_model("tiny-py-target", dtype=torch.float32)


def _parse_like_lm_eval(response: dict, ctxlens: list[int]) -> list[tuple[float, bool]]:
    """lm-eval's LocalCompletionsAPI.parse_logprobs: the continuation is the
    echoed tokens after the context, minus the one generated token at the end."""
    out = []
    for choice, ctxlen in zip(sorted(response["choices"], key=lambda c: c["index"]), ctxlens):
        lps = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        out.append((sum(lps), all(t == max(top.values()) for t, top in zip(lps, tops))))
    return out


def _hf_score(hf, ctx: list[int], cont: list[int]) -> tuple[float, bool]:
    with torch.no_grad():
        lp = hf(torch.tensor([ctx + cont])).logits[0].float().log_softmax(-1)
    rows = lp[len(ctx) - 1:len(ctx) + len(cont) - 1]
    target = torch.tensor(cont)
    return rows.gather(1, target[:, None]).sum().item(), bool((rows.argmax(-1) == target).all())


@pytest.mark.parametrize("max_tokens", [1, 0])
def test_lm_eval_request_shapes_score_like_hf(api_server, hf, max_tokens):
    tok = load_tiny_tokenizer()
    pairs = [(tok.encode(c, add_special_tokens=False), tok.encode(x, add_special_tokens=False))
             for c, xs, _ in CHOICE_DOCS[:3] for x in xs[:2]]
    body = {"model": SERVED_NAME, "prompt": [c + x for c, x in pairs], "temperature": 0, "max_tokens": max_tokens,
            "logprobs": 1, "seed": 1234, "echo": True}
    r = httpx.post(api_server.url + "/v1/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text[:300]
    resp = r.json()
    for ch, (c, x) in zip(sorted(resp["choices"], key=lambda c: c["index"]), pairs):
        lp = ch["logprobs"]
        n = len(c) + len(x) + (max_tokens == 1)
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == n, \
            "echo must return every prompt token (plus the generated one unless max_tokens=0)"
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None, "nothing scores the first token"
        if max_tokens == 0:
            assert ch["text"] == tok.decode(c + x), "max_tokens=0 with echo returns the prompt alone"
    if max_tokens == 0:  # lm-eval's parser drops the last entry: with max_tokens=0 that is a prompt token
        for ch in resp["choices"]:
            ch["logprobs"]["token_logprobs"].append(None)
            ch["logprobs"]["top_logprobs"].append(None)
    got = _parse_like_lm_eval(resp, [len(c) for c, _ in pairs])
    for (ll, greedy), (c, x) in zip(got, pairs):
        want_ll, want_greedy = _hf_score(hf, c, x)
        assert ll == pytest.approx(want_ll, abs=1e-4), "the server's log-likelihood differs from HF's"
        assert greedy == want_greedy, "is_greedy differs from HF's argmax"


def _write_tasks(folder):
    with open(folder / "choice.jsonl", "w") as f:
        for ctx, choices, label in CHOICE_DOCS:
            f.write(json.dumps({"context": ctx, "choices": choices, "label": label}) + "\n")
    with open(folder / "rolling.jsonl", "w") as f:
        for text in ROLLING_DOCS:
            f.write(json.dumps({"text": text}) + "\n")
    (folder / "choice.yaml").write_text(
        "task: tiny_py_choice\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {folder / 'choice.jsonl'}\ntest_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "{{context}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{label}}"\n'
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    (folder / "rolling.yaml").write_text(
        "task: tiny_py_rolling\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {folder / 'rolling.jsonl'}\ntest_split: test\noutput_type: loglikelihood_rolling\n"
        'doc_to_text: ""\ndoc_to_target: "{{text}}"\n'
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n")


def test_lm_eval_loglikelihood_tasks_through_the_server_equal_hf(api_server, tmp_path, monkeypatch):
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)  # local-completions sends it as the bearer token
    _write_tasks(tmp_path)
    tasks = ["tiny_py_choice", "tiny_py_rolling"]
    runs = {}
    for name, model, args in [
        ("server", "local-completions",
         f"model={SERVED_NAME},base_url={api_server.url}/v1/completions,tokenizer={target_path()},"
         "tokenizer_backend=huggingface,max_length=1024,num_concurrent=1,max_retries=1"),
        ("hf", "hf", f"pretrained={target_path()},dtype=float32,device=cpu"),
    ]:
        runs[name] = lm_eval.simple_evaluate(model=model, model_args=args, tasks=tasks, batch_size=4,
                                             task_manager=TaskManager(include_path=str(tmp_path)),
                                             log_samples=True)
    srv, ref = runs["server"], runs["hf"]
    for task in tasks:
        a = sorted(srv["samples"][task], key=lambda s: s["doc_id"])
        b = sorted(ref["samples"][task], key=lambda s: s["doc_id"])
        assert len(a) == len(b) > 0
        for sa, sb in zip(a, b):
            for ra, rb in zip(sa["resps"], sb["resps"]):
                va, vb = ra[0], rb[0]
                if task == "tiny_py_choice":
                    assert va[0] == pytest.approx(vb[0], abs=1e-4) and va[1] == vb[1], \
                        f"{task} doc {sa['doc_id']}: server {va} != hf {vb}"
                else:
                    assert va == pytest.approx(vb, abs=1e-4), f"{task} doc {sa['doc_id']}: {va} != {vb}"
        for metric, value in ref["results"][task].items():
            if isinstance(value, float) and "stderr" not in metric:
                assert srv["results"][task][metric] == pytest.approx(value, rel=1e-5), \
                    f"{task} {metric}: server {srv['results'][task][metric]} != hf {value}"
