"""Export the project's RULER samples (:mod:`tools.ruler`, the samples ``benchmarks/ruler_sweep.py``
scores) as local lm-eval tasks: one JSONL of documents and one YAML per task, a group YAML
``ruler_nanovllm`` over them, and ``utils.py`` with RULER's metric (``string_match_all``), so that

    python -m nanovllm.integrations.lm_eval --model nanovllm --model_args pretrained=DIR,... \\
        --tasks ruler_nanovllm --include_path OUT

scores what ``python -m benchmarks.ruler_sweep`` scores for the same samples (greedy, each task's
RULER token budget). Samples are built exactly as ``ruler_sweep`` builds them (prompts of
``length - ANSWER_ROOM`` tokens, RULER's chat-templated prompt with the answer prefix), or read
from a file its ``--make-samples`` wrote. lm-eval gives a backend text, so each document holds
the prompt decoded, and a backend encodes it again: where that does not give the very ids (a
haystack cut inside a word), the prompt lm-eval runs differs by a token or so. So the export also
writes ``OUT/samples.pt``, the samples with the ids the text encodes to, in ``ruler_sweep``'s
``--samples`` format: ``ruler_sweep --samples OUT/samples.pt`` scores exactly the prompts lm-eval
runs. The export says how many samples of each task re-encode differently.

    python -m tools.ruler_lm_eval --model DIR --out OUT --length 4096 \\
        --tasks niah_single_numbers,niah_multikey,vt,cwe,fwe --num-samples 20
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from tools import ruler

ANSWER_ROOM = max(ruler.MAX_NEW_TOKENS.values())
"""As ``benchmarks.ruler_sweep.ANSWER_ROOM``: a length L has prompts of L - ANSWER_ROOM tokens."""
GROUP = "ruler_nanovllm"

UTILS = '''"""RULER's metric for the exported tasks (tools/ruler_lm_eval.py): string_match_all, the share of
the reference strings found in the output, case-insensitive (tools.ruler.string_match_all)."""
import re


def string_match_all(output: str, answers: list) -> float:
    output = re.sub(r"[\\x00-\\x1f]", "\\n", output).lower()
    return sum(a.lower() in output for a in answers) / len(answers)


def process_results(doc, results):
    return {"ruler_score": string_match_all(results[0], doc["answers"])}
'''


def export(tokenizer, samples: dict[str, list[dict]], out: Path, length: int) -> tuple[dict[str, int], dict]:
    """Write ``samples`` (``{task: [sample]}``, :func:`tools.ruler.generate_samples`'s form) under
    ``out``. Returns per task the samples whose decoded text does not encode back to their ids,
    and the samples as lm-eval's backends will tokenize them (``{task: [sample]}``)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "utils.py").write_text(UTILS)
    mismatches, names, encoded = {}, [], {}
    for task, batch in samples.items():
        name = f"ruler_{task}_{length}"
        names.append(name)
        path = out / f"{name}.jsonl"
        bad, encoded[task] = 0, []
        with path.open("w") as f:
            for i, sample in enumerate(batch):
                text = tokenizer.decode(sample["input_ids"])
                ids = tokenizer.encode(text)  # as the backends' tok_encode does
                bad += ids != list(sample["input_ids"])
                encoded[task].append({**sample, "input_ids": ids})
                f.write(json.dumps({"index": i, "text": text, "answers": list(sample["answers"])}) + "\n")
        mismatches[task] = bad
        max_new = batch[0]["max_new_tokens"] if batch else ruler.MAX_NEW_TOKENS[task]
        (out / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {path.resolve()}\n"
            f"test_split: test\noutput_type: generate_until\ndoc_to_text: \"{{{{text}}}}\"\n"
            f"doc_to_target: \"{{{{answers}}}}\"\nprocess_results: !function utils.process_results\n"
            f"generation_kwargs:\n  until: []\n  max_gen_toks: {max_new}\n  do_sample: false\n"
            f"metric_list:\n  - metric: ruler_score\n    aggregation: mean\n    higher_is_better: true\n")
    (out / f"{GROUP}.yaml").write_text(f"group: {GROUP}\ntask:\n" + "".join(f"  - {n}\n" for n in names) +
                                       "aggregate_metric_list:\n  - metric: ruler_score\n    aggregation: mean\n"
                                       "    weight_by_size: false\n")
    return mismatches, encoded


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="model directory (its tokenizer builds and decodes the samples)")
    parser.add_argument("--out", required=True, type=Path, help="directory for the JSONL and YAML files")
    parser.add_argument("--length", type=int, default=4096, help="RULER sequence length (prompt + answer room)")
    parser.add_argument("--tasks", default="niah_single_numbers,niah_multikey,vt,cwe,fwe",
                        help=f"comma-separated, of {', '.join(ruler.TASKS)}")
    parser.add_argument("--num-samples", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--samples", type=Path, help="samples saved by benchmarks.ruler_sweep --make-samples")
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tasks = [ruler.resolve_task(t) for t in args.tasks.split(",") if t]
    if args.samples:
        import torch

        saved = torch.load(args.samples)[args.length]
        samples = {t: saved[t] for t in tasks}
    else:
        samples = {t: ruler.generate_samples(tokenizer, t, args.num_samples, args.length - ANSWER_ROOM, seed=args.seed)
                   for t in tasks}
    mismatches, encoded = export(tokenizer, samples, args.out, args.length)
    import torch

    torch.save({args.length: encoded}, args.out / "samples.pt")
    for task, bad in mismatches.items():
        note = "" if not bad else f" ({bad} re-encode to other ids: samples.pt holds those)"
        print(f"{task}: {len(samples[task])} samples{note}")
    print(f"lm-eval group {GROUP!r} in {args.out} (--include_path {args.out} --tasks {GROUP}); the same prompts "
          f"for benchmarks.ruler_sweep: --samples {args.out / 'samples.pt'} --lengths {args.length}")


if __name__ == "__main__":
    main()
