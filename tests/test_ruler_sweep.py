"""benchmarks/ruler_sweep.py without a model: setting names, the paired difference, the tables
and the split of a sweep into jobs (their command lines and the merge of their lines)."""
import dataclasses
import json
import math
import sys

import pytest

from benchmarks import ruler_sweep as rs
from nanovllm.config import Config


def _line(setting, scores, length=4096, digest="d"):
    return {"setting": setting, "input_len": length, "overall": sum(map(sum, scores.values())) / sum(
        map(len, scores.values())), "tasks": {t: sum(v) / len(v) for t, v in scores.items()}, "scores": scores,
        "samples_digest": {t: digest for t in scores}, "generate_seconds": 1.0}


def test_setting_names_parse_and_reject():
    fields = rs.setting_fields("quest-p32-b1024-sum-d2-host")
    assert fields["sparse_page_size"] == 32 and fields["sparse_token_budget"] == 1024
    assert fields["sparse_group_score"] == "sum" and fields["sparse_dense_layers"] == 2
    assert fields["enable_offload"] and "num_ring_slots" not in fields, "the engine's ring"
    assert rs.setting_fields("full-host") == {"enable_offload": True}
    assert rs.setting_fields("full-host-3") == {"enable_offload": True, "num_ring_slots": 3, "blocks": 4}
    assert rs.block_size("full-host", 32768, 1024) == 1024
    assert rs.setting_fields("streaming-p16-d0")["sparse_policy"] == "STREAMING"
    with pytest.raises(ValueError, match="unknown setting 'quest-p16-d0'"):
        rs.setting_fields("quest-p16-d0")  # QUEST needs a budget
    with pytest.raises(ValueError, match="unknown setting"):
        rs.setting_fields("streaming-p16-b2048-max-d0")
    oracle = rs.setting_fields("oracle-p16-b2944-max-d0")
    assert oracle["sparse_policy"] == "ORACLE" and oracle["sparse_token_budget"] == 2944
    with pytest.raises(ValueError, match="unknown setting 'oracle-p16-d0'"):
        rs.setting_fields("oracle-p16-d0")  # ORACLE needs a budget
    assert rs.setting_fields("quest-p16-b2048-max-w0.5-d0")["sparse_radius_weight"] == 0.5
    assert rs.setting_fields("quest-p16-b2048-max-d0")["sparse_radius_weight"] == 1.0, "no -w: Quest's bound"
    assert "sparse_radius_weight" not in rs.setting_fields("moments-p16-b2048-max-d0")
    assert rs.setting_fields("moments-p16-b2048-sum-d0")["sparse_policy"] == "MOMENTS"
    with pytest.raises(ValueError, match="the radius weight"):
        rs.setting_fields("oracle-p16-b2048-max-w0.5-d0")
    assert rs.setting_fields("full-fp8") == {"kv_cache_dtype": "fp8_e4m3"}
    fp8 = rs.setting_fields("quest-p16-b2048-max-d0-host-fp8")
    assert fp8 == rs.setting_fields("quest-p16-b2048-max-d0-host") | {"kv_cache_dtype": "fp8_e4m3"}
    settings = rs.make_settings("oracle-p16-b1024-max-d0-host-fp8", 4096, ["niah_single_1"], 2, 1024, 16, 256,
                                device="cpu")
    assert settings.kv_cache_dtype == "fp8_e4m3" and settings.num_reuse_cache_blocks == 4, "reuse cells for its picks"
    assert settings.engine_kwargs()["kv_cache_dtype"] == "fp8_e4m3"
    by_layer = rs.setting_fields("quest-p16-b2048-sum-w0.5-d0-lw-s16-r32-host")
    assert by_layer == rs.setting_fields("quest-p16-b2048-sum-w0.5-d0-s16-r32-host") | {"by_layer": True}
    with pytest.raises(ValueError, match="shares its budget by layer: give --layer-budget-weights"):
        rs.make_settings("quest-p16-b2048-sum-d0-lw", 4096, ["niah_single_1"], 2, 1024, 16, 256, device="cpu")
    with pytest.raises(ValueError, match="unknown setting 'streaming-p16-d0-lw'"):
        rs.setting_fields("streaming-p16-d0-lw")
    # the reuse cells hold the largest layer budget's picks: 3 x 1024 x 2 / (1 + 3) tokens = 3 blocks
    settings = rs.make_settings("quest-p16-b1024-max-d0-lw-host", 4096, ["niah_single_1"], 2, 1024, 16, 256,
                                device="cpu", layer_weights=[1.0, 3.0])
    assert settings.num_reuse_cache_blocks == 2 * 1536 * 2 // 1024
    assert settings.engine_kwargs()["sparse_layer_budget_weights"] == (1.0, 3.0)


def test_grid_starts_at_the_engine_defaults_and_names_round_trip():
    engine = {f.name: f.default for f in dataclasses.fields(Config)}
    args = rs.build_parser().parse_args(["--lengths", "4096"])
    names = rs.grid(args.policies, args.page_sizes, args.budgets, args.group_scores, args.dense_layers, args.design,
                    weights=args.radius_weights)
    assert names[0] == "full" and len(names) == 1 + 8 + 4
    base = rs.setting_fields(names[1])
    for option in ("sparse_policy", "sparse_page_size", "sparse_token_budget", "sparse_group_score",
                   "sparse_radius_weight", "sparse_dense_layers"):
        assert base[option] == (engine[option] if option != "sparse_policy" else "QUEST"), option
    weights = {rs.setting_fields(n).get("sparse_radius_weight") for n in names if n.startswith("quest")}
    assert weights == {engine["sparse_radius_weight"], 1.0}
    assert rs.choosing_name("QUEST", 16, 0, 2048, "max", weight=0.25) == "quest-p16-b2048-max-w0.25-d0"
    assert rs.choosing_name("QUEST", 16, 0, 2048, "max") == "quest-p16-b2048-max-d0"


def test_paired_difference_is_mean_and_standard_error_of_per_sample_differences():
    full = _line("full", {"a": [1, 1, 0, 1], "b": [1, 0]})
    quest = _line("quest-p16-b2048-max-d0", {"a": [1, 0, 0, 0], "b": [1, 1]})
    per_task, (diff, se) = rs.paired_difference(quest, full)
    d_a = [0, -1, 0, -1]
    se_a = math.sqrt(sum((x + 0.5) ** 2 for x in d_a) / 3 / 4)
    assert per_task["a"] == pytest.approx((-0.5, se_a))
    assert per_task["b"] == pytest.approx((0.5, 0.5))
    assert diff == pytest.approx(0.0) and se == pytest.approx(math.sqrt(se_a ** 2 + 0.25) / 2)
    other = dict(quest, samples_digest={"a": "x", "b": "d"})  # other samples of task a: not paired
    assert set(rs.paired_difference(other, full)[0]) == {"b"}


def test_table_pairs_each_row_with_full_on_the_same_samples(tmp_path):
    path = tmp_path / "sweep.jsonl"
    lines = [_line("quest-p16-b2048-max-d0", {"niah_single_1": [0, 1]}), _line("full", {"niah_single_1": [1, 1]}),
             {"setting": "quest-p64-b2048-max-d0", "error": "ValueError: boom"}]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    text = rs.table(str(path))
    rows = [r for r in text.splitlines() if r.startswith("| full") or r.startswith("| quest")]
    assert rows[0].startswith("| full | 4096") and "(baseline)" in rows[0]  # FULL first
    assert "-50.0 ± 50.0" in rows[1]
    assert "failed: quest-p64-b2048-max-d0: ValueError: boom" in text


def test_job_split_deals_settings_round_robin_without_empty_jobs():
    names = ["full", "q1", "q2", "q3", "q4"]
    assert rs.job_split(names, 2) == [["full", "q2", "q4"], ["q1", "q3"]]
    assert rs.job_split(names[:2], 4) == [["full"], ["q1"]]
    assert sorted(sum(rs.job_split(names, 3), [])) == sorted(names)


def test_job_argv_carries_the_sweep_options(tmp_path):
    args = rs.build_parser().parse_args(["--model", "M", "--lengths", "4096,32768", "--num-samples", "5",
                                         "--tasks", "niah_single_1,vt", "--sink-tokens", "32", "--jobs", "3",
                                         "--block-size", "2048", "--gpu-memory-utilization", "0.6"])
    argv = rs.job_argv(args, ["full", "streaming-p16-d0"], "s.pt", "out.job1", 0.2)
    assert argv[:3] == [sys.executable, "-m", "benchmarks.ruler_sweep"]
    child = rs.build_parser().parse_args(argv[3:])
    for name in ("model", "lengths", "num_samples", "tasks", "sink_tokens", "recent_tokens", "block_size", "device"):
        assert getattr(child, name) == getattr(args, name), name
    assert child.settings == ["full", "streaming-p16-d0"] and child.samples == "s.pt" and child.out == "out.job1"
    assert child.gpu_memory_utilization == pytest.approx(0.2) and child.jobs == 1 and child.no_table
    assert child.layer_budget_weights is None
    args.layer_budget_weights = "weights.json"
    child = rs.build_parser().parse_args(rs.job_argv(args, ["quest-p16-b2048-sum-d0-lw"], "s.pt", "o", 0.2)[3:])
    assert child.layer_budget_weights == "weights.json"


def test_sweep_in_jobs_merges_the_jobs_lines_in_settings_order(tmp_path, monkeypatch, capsys):
    """Each job (here a stand-in that writes one line per setting it was given) writes its own
    file; the parent appends them to --out in the order of --settings and reports a failed job."""
    out = tmp_path / "sweep.jsonl"
    writer = ("import json, sys; names, path = sys.argv[1].split(','), sys.argv[2]\n"
              "open(path, 'a').write(''.join(json.dumps({'setting': n, 'input_len': 4096, 'overall': 0.5, "
              "'tasks': {'vt': 0.5}, 'scores': {'vt': [0, 1]}, 'samples_digest': {'vt': 'd'}, "
              "'generate_seconds': 1.0}) + '\\n' for n in names))\n"
              "sys.exit(3 if 'streaming-p16-d0' in names else 0)")
    seen = []

    def fake_argv(args, names, samples, path, utilization):
        seen.append((names, samples, utilization))
        return [sys.executable, "-c", writer, ",".join(names), path]

    monkeypatch.setattr(rs, "job_argv", fake_argv)
    args = rs.build_parser().parse_args(["--model", "M", "--samples", "s.pt", "--jobs", "2", "--out", str(out),
                                         "--gpu-memory-utilization", "0.8", "--settings",
                                         "full,quest-p16-b2048-max-d0,streaming-p16-d0,quest-p32-b2048-max-d0"])
    with pytest.raises(RuntimeError, match=r"sweep.jsonl.job0.log \(exit 3\)"):
        rs.sweep(args)
    assert [x[0] for x in seen] == [["full", "streaming-p16-d0"], ["quest-p16-b2048-max-d0", "quest-p32-b2048-max-d0"]]
    assert all(s == "s.pt" and u == pytest.approx(0.4) for _, s, u in seen)
    merged = [json.loads(x)["setting"] for x in out.read_text().splitlines()]
    assert merged == args.settings
    assert "| quest-p16-b2048-max-d0 | 4096 |" in capsys.readouterr().out


def test_line_records_the_decode_per_layer_and_the_pairing_digests():
    from tools.ruler.evaluation import RulerReport, TaskResult

    result = TaskResult("vt", [1.0, 0.0], ["a b", "x"], [["a", "b"], ["c"]], ["stop", "stop"], [3, 2], 0.1)
    per_layer = [{"layer": 0, "comm_density": None, "reuse_rate": 0.876543, "density": 0.0712345}]
    stats = {"policy": "QUEST", "prefill": {"density": 1.0},
             "decode": {"density": 0.07, "reuse_rate": 0.88, "per_layer": per_layer}}
    report = RulerReport([result], 4096, settings={"block_size": 1024}, dtype="bfloat16", sparse_stats=stats)
    samples = {"vt": [{"input_ids": [1, 2], "answers": ["a", "b"]}, {"input_ids": [3], "answers": ["c"]}]}
    line = rs._line("quest-p16-b2048-max-d0", 4096, report, 1.23, samples, {"sparse_page_size": 16})
    assert line["decode_per_layer"] == [{"layer": 0, "comm_density": None, "reuse_rate": 0.8765, "density": 0.0712}]
    assert line["scores"] == {"vt": [1.0, 0.0]} and line["overall"] == 0.5 and line["generate_seconds"] == 1.2
    assert line["samples_digest"]["vt"] == rs.samples_digest(samples["vt"])
    assert line["outputs"] == {"vt": ["x"]}  # the outputs of missed samples only
    json.dumps(line)  # a JSON line


def test_table_of_several_files_shows_a_repeated_run_once(tmp_path):
    full = _line("full", {"vt": [1, 1]})
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text(json.dumps(full) + "\n" + json.dumps(_line("streaming-p16-d0", {"vt": [0, 1]})) + "\n")
    b.write_text(json.dumps(dict(full, generate_seconds=9.0)) + "\n"
                 + json.dumps(_line("full", {"vt": [1, 0]}, length=8192)) + "\n")
    lines = rs.read_lines([str(a), str(b)])
    assert [(x["setting"], x["input_len"]) for x in lines] == [("full", 4096), ("streaming-p16-d0", 4096),
                                                                ("full", 8192)]
    rows = [r for r in rs.table([str(a), str(b)]).splitlines() if r.startswith("| full |")]
    assert len(rows) == 2
    with pytest.raises(FileNotFoundError, match="no sweep file .*missing.jsonl"):
        rs.read_lines([str(a), str(tmp_path / "missing.jsonl")])
