"""lm-evaluation-harness against kiln as a new user runs it: `local-completions` with only
`base_url` and `model` (no tokenizer: lm-eval reads GET /tokenizer_info and tokenizes through
/tokenize and /detokenize), against the oracle of lm-eval's own `hf` model on the same GGUF
(transformers dequantizes it to float32, as kiln computes on the CPU).

Two tasks the test writes (nothing comes from the hub): 24 multiple-choice questions, scored
by loglikelihood (kiln's echoed prompt logprobs), and greedy generations of a few prompts.
One kiln server and one transformers model for the module.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from api_server import MODEL, KilnServer

# Read when datasets and huggingface_hub are imported: nothing here may reach the hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

pytestmark = pytest.mark.slow

LOGLIKELIHOOD_ATOL = 1e-3  # measured: about 6e-5 (issue 32)
MAX_GEN_TOKS = 16
# (question, choices, index of the right one): easy and hard, so accuracy is neither 0 nor 1.
QUESTIONS = [
    ("What is the capital of France?", ["Paris", "London", "Berlin", "Madrid"], 0),
    ("How many legs does a spider have?", ["Six", "Eight", "Four", "Ten"], 1),
    ("What colour is the sky on a clear day?", ["Green", "Red", "Blue", "Black"], 2),
    ("Which animal barks?", ["Cat", "Cow", "Fish", "Dog"], 3),
    ("What is 2 plus 2?", ["Four", "Five", "Three", "Six"], 0),
    ("Which planet is closest to the Sun?", ["Venus", "Mercury", "Mars", "Earth"], 1),
    ("What do bees make?", ["Milk", "Silk", "Honey", "Wool"], 2),
    ("What is frozen water called?", ["Steam", "Sand", "Salt", "Ice"], 3),
    ("Who wrote Romeo and Juliet?", ["Shakespeare", "Dickens", "Tolstoy", "Homer"], 0),
    ("What gas do plants take in?", ["Oxygen", "Carbon dioxide", "Helium", "Neon"], 1),
    ("How many days are in a week?", ["Five", "Six", "Seven", "Eight"], 2),
    ("What is the largest ocean?", ["Atlantic", "Indian", "Arctic", "Pacific"], 3),
    ("What is the chemical symbol for gold?", ["Au", "Ag", "Fe", "Pb"], 0),
    ("Which metal is liquid at room temperature?", ["Iron", "Mercury", "Copper", "Zinc"], 1),
    ("What is the square root of 81?", ["7", "8", "9", "10"], 2),
    ("In which continent is Kenya?", ["Asia", "Europe", "America", "Africa"], 3),
    ("What language is spoken in Brazil?", ["Portuguese", "Spanish", "French", "Italian"], 0),
    ("How many sides does a hexagon have?", ["Five", "Six", "Seven", "Eight"], 1),
    ("Which organ pumps blood?", ["Lung", "Liver", "Heart", "Kidney"], 2),
    ("What is the boiling point of water in Celsius?", ["50", "80", "90", "100"], 3),
    ("Which is a prime number?", ["7", "8", "9", "10"], 0),
    ("Who painted the Mona Lisa?", ["Picasso", "Leonardo da Vinci", "Monet", "Dali"], 1),
    ("What is the currency of Japan?", ["Dollar", "Euro", "Yen", "Pound"], 2),
    ("Which bird cannot fly?", ["Eagle", "Sparrow", "Owl", "Penguin"], 3),
]
PROMPTS = ["The capital of France is", "Once upon a time, there was a",
           "The three primary colours are", "def fibonacci(n):\n"]


def write_task(folder: Path, name: str, rows: list[dict], spec: str) -> None:
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {data}\ntest_split: test\n{spec}")


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("lm-eval-tasks")
    write_task(folder, "kiln_mc", [{"question": q, "choices": c, "answer": a}
                                   for q, c, a in QUESTIONS],
               'output_type: multiple_choice\ndoc_to_text: "Question: {{question}}\\nAnswer:"\n'
               'doc_to_choice: "{{choices}}"\ndoc_to_target: answer\n'
               "metric_list:\n  - metric: acc\n    aggregation: mean\n"
               "    higher_is_better: true\n")
    write_task(folder, "kiln_gen", [{"prompt": p} for p in PROMPTS],
               'output_type: generate_until\ndoc_to_text: "{{prompt}}"\ndoc_to_target: ""\n'
               f'generation_kwargs:\n  until: ["\\n\\n"]\n  max_gen_toks: {MAX_GEN_TOKS}\n'
               # kiln applies the model's sampling defaults to fields a request leaves out
               # (SmolLM2's repetition penalty of 1.1), transformers its own (none).
               "  do_sample: false\n  temperature: 0\n  repetition_penalty: 1.0\n"
               "metric_list:\n  - metric: exact_match\n    aggregation: mean\n"
               "    higher_is_better: true\n")
    return folder


def evaluate(lm, tasks: Path) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(model=lm, tasks=["kiln_mc", "kiln_gen"], log_samples=True,
                           task_manager=TaskManager(include_path=str(tasks),
                                                    include_defaults=False),
                           bootstrap_iters=0)


@pytest.fixture(scope="module")
def kiln_lm(tmp_path_factory):
    """`--model local-completions --model_args base_url=...,model=... --batch_size 8`."""
    from lm_eval.api.registry import get_model

    with KilnServer(tmp_path_factory.mktemp("kiln-lm-eval"), "--dtype", "float32") as server:
        yield get_model("local-completions").create_from_arg_string(
            f"base_url={server.url}/v1/completions,model={MODEL}", {"batch_size": 8})


@pytest.fixture(scope="module")
def kiln_run(kiln_lm, tasks) -> dict:
    return evaluate(kiln_lm, tasks)


@pytest.fixture(scope="module")
def hf_run(smollm2_gguf, tasks) -> dict:
    """lm-eval's `hf` model on the same file, one sequence at a time (no padding)."""
    from lm_eval.api.registry import get_model

    path = Path(smollm2_gguf)
    lm = get_model("hf").create_from_arg_string(
        f"pretrained={path.parent},gguf_file={path.name},dtype=float32",
        {"batch_size": 1, "device": "cpu"})
    return evaluate(lm, tasks)


def samples(run: dict, task: str) -> list[dict]:
    return sorted(run["samples"][task], key=lambda s: s["doc_id"])


def test_lm_eval_tokenizes_through_the_server_with_no_tokenizer_argument(kiln_lm):
    assert kiln_lm.tokenizer_backend == "remote"
    # What lm-eval reads from /tokenizer_info and /tokenize: SmolLM2's ChatML tokens.
    assert (kiln_lm.tokenizer.bos_token, kiln_lm.tokenizer.eos_token) == \
        ("<|im_start|>", "<|im_end|>")
    assert (kiln_lm.prefix_token_id, kiln_lm.eot_token_id) == (1, 2)


def test_multiple_choice_accuracy_is_the_hf_models(kiln_run, hf_run):
    kiln_acc = kiln_run["results"]["kiln_mc"]["acc,none"]
    hf_acc = hf_run["results"]["kiln_mc"]["acc,none"]
    assert len(samples(kiln_run, "kiln_mc")) == len(QUESTIONS)
    assert kiln_acc == hf_acc, (kiln_acc, hf_acc)
    assert 0 < kiln_acc < 1  # the questions tell the models apart from chance and from perfect


def test_every_loglikelihood_is_the_hf_models_within_1e_3(kiln_run, hf_run):
    worst = (0.0, None)
    pairs = list(zip(samples(kiln_run, "kiln_mc"), samples(hf_run, "kiln_mc"), strict=True))
    for kiln, hf in pairs:
        assert kiln["doc_id"] == hf["doc_id"]
        kiln_ll = [ll for ll, _ in kiln["filtered_resps"]]
        hf_ll = [ll for ll, _ in hf["filtered_resps"]]
        assert len(kiln_ll) == len(hf_ll) == 4
        for choice, (a, b) in enumerate(zip(kiln_ll, hf_ll, strict=True)):
            assert a < 0 and b < 0
            worst = max(worst, (abs(a - b), (kiln["doc_id"], choice, a, b)))
    assert worst[0] <= LOGLIKELIHOOD_ATOL, f"largest |kiln - hf| loglikelihood: {worst}"


def test_greedy_generations_are_the_hf_models(kiln_run, hf_run):
    kiln_text = [s["filtered_resps"][0] for s in samples(kiln_run, "kiln_gen")]
    hf_text = [s["filtered_resps"][0] for s in samples(hf_run, "kiln_gen")]
    assert len(kiln_text) == len(PROMPTS) and all(kiln_text)
    assert kiln_text == hf_text
