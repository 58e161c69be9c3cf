"""Configuration: YAML < --set, and one clear line for every mistake."""

from __future__ import annotations

from pathlib import Path

import pytest

from pyrecover import config
from pyrecover.config import ConfigError

EXPERIMENTS = sorted((Path(__file__).parents[2] / "launch" / "experiments").glob("*.yaml"))


@pytest.mark.parametrize("path", EXPERIMENTS, ids=lambda p: p.name)
def test_every_shipped_experiment_config_is_valid(path):
    config.load(path)


def test_the_shipped_experiments_include_the_ones_users_are_promised():
    assert {"tiny.yaml", "demo.yaml", "gpt-125m.yaml", "gpt-1b.yaml", "gpt-7b.yaml"} <= {
        p.name for p in EXPERIMENTS}


@pytest.mark.parametrize("name", ["gpt-1b.yaml", "gpt-7b.yaml"])
def test_the_large_experiments_shard_with_fsdp_and_write_their_own_shards(name):
    cfg = config.load(next(p for p in EXPERIMENTS if p.name == name))
    assert (cfg.train.parallel, cfg.checkpoint.mode) == ("fsdp", "dcp")


def test_fsdp_settings_are_checked_in_one_line():
    for mode in ("vanilla", "dcp", "memory"):  # every checkpoint mode works with fsdp
        assert config.load(None, ["train.parallel=fsdp", f"checkpoint.mode={mode}"])
    with pytest.raises(ConfigError, match="train.parallel='zero3' is not allowed: expected one "
                                          "of ddp, fsdp"):
        config.load(None, ["train.parallel=zero3"])
    with pytest.raises(ConfigError, match="checkpoint.gather_max_gb"):
        config.load(None, ["checkpoint.gather_max_gb=0"])


def test_demo_yaml_spells_out_the_embedded_defaults():
    demo = next(p for p in EXPERIMENTS if p.name == "demo.yaml")
    assert config.load(demo) == config.load(None)


def test_set_overrides_the_file_and_the_file_overrides_the_defaults(tmp_path):
    f = tmp_path / "exp.yaml"
    f.write_text("train:\n  max_steps: 7\n  lr: 0.01\n")
    cfg = config.load(f, ["train.lr=2e-3", "model.dropout=0.1", "run.exp_name=x1"])
    assert (cfg.train.max_steps, cfg.train.lr, cfg.model.dropout) == (7, 2e-3, 0.1)
    assert cfg.run.exp_name == "x1"
    assert cfg.train.seed == config.TrainConfig().seed


def test_a_set_value_with_a_space_and_hash_is_kept_whole_not_cut_at_a_yaml_comment():
    """`--set "run.storage=/scratch/run #3"` launched into /scratch/run: YAML took ` #3` for
    a comment, without a word."""
    cfg = config.load(None, ["run.storage=/scratch/run #3", "data.path=/d/a #b.parquet",
                             "run.exp_name='quoted'"])
    assert (cfg.run.storage, cfg.data.path) == ("/scratch/run #3", "/d/a #b.parquet")
    assert cfg.run.exp_name == "quoted"  # YAML's quotes still read as YAML


def test_a_dumped_config_loads_back_equal(tmp_path):
    cfg = config.load(None, ["train.max_steps=11", "run.storage=/some where/with space"])
    f = tmp_path / "run.yaml"
    f.write_text(config.dump(cfg))
    assert config.load(f) == cfg


@pytest.mark.parametrize("overrides, message", [
    (["train.max_stepz=3"], "unknown key 'train.max_stepz'"),
    (["trian.max_steps=3"], "unknown key 'trian'"),
    (["train.max_steps=three"], "train.max_steps='three' is not allowed: expected a whole "
                                "number"),
    (["train.max_steps=0"], "train.max_steps=0 is not allowed: expected an integer >= 1"),
    (["checkpoint.keep=1"], "checkpoint.keep=1 is not allowed: expected at least 2"),
    (["checkpoint.mode=zip"], "checkpoint.mode='zip' is not allowed: expected one of vanilla"),
    (["model.n_embd=100", "model.n_head=3"], "model.n_embd=100 is not allowed"),
    (["train.global_batch_size=10", "train.micro_batch_size=4"], "train.global_batch_size=10"),
    (["train.max_steps"], "expected section.key=value"),
    (["train.lr=true"], "train.lr=true is not allowed: expected a number"),
    # A word YAML reads as a boolean: said as such, not as Python's False.
    (["run.hang_startup_timeout=off"], "run.hang_startup_timeout=false is not allowed: "
                                       "expected a number (YAML reads on/off and yes/no as "
                                       "true/false)"),
    # Sizes past any run's: a step that would list its ids until memory ran out.
    (["train.global_batch_size=auto:99999999999999999999"],
     "train.global_batch_size='auto:99999999999999999999' is not allowed: expected a number "
     "of sequences from 1 to 1,048,576"),
    (["train.global_batch_size=2097152"], "train.global_batch_size=2097152 is not allowed"),
    (["train.micro_batch_size=99999999999999", "train.global_batch_size=auto"],
     "train.micro_batch_size=99999999999999 is not allowed"),
    (["checkpoint.interval=99999999999999999999"], "expected a 64-bit integer"),
])
def test_each_mistake_is_one_line_naming_the_key_and_what_is_allowed(overrides, message):
    with pytest.raises(ConfigError) as err:
        config.load(None, overrides)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("name", ["../escape", "a/b", "..", ".hidden", "has space", "a;b",
                                  "$(id)", "x\ny", "quo'te", ""])
def test_experiment_names_that_could_leave_the_storage_root_are_refused(name):
    with pytest.raises(ConfigError, match="run.exp_name"):
        config.load(None, [f"run.exp_name={name}"]) if "\n" not in name else config.from_dict(
            {"run": {"exp_name": name}})


def test_an_unknown_set_key_blames_the_set_flag_not_the_config_file(tmp_path):
    f = tmp_path / "exp.yaml"
    f.write_text("train:\n  max_steps: 7\n")
    for overrides, said in ((["train.nope=1"], "--set train.nope: unknown key 'train.nope'"),
                            (["model.n_layer.x=1"], "--set model.n_layer.x: model.n_layer is "
                                                    "a value, not a section")):
        with pytest.raises(ConfigError) as err:
            config.load(f, overrides)
        assert str(err.value).startswith(said), err.value
        assert "exp.yaml" not in str(err.value)


def test_a_file_whose_section_is_a_value_is_blamed_even_with_a_set_under_it(tmp_path):
    f = tmp_path / "exp.yaml"
    f.write_text("train: 3\n")
    with pytest.raises(ConfigError, match=r"exp.yaml: train must be a mapping, got 3$"):
        config.load(f, ["train.max_steps=2"])


def test_a_missing_config_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        config.load(tmp_path / "nope.yaml")


@pytest.mark.parametrize("text", ["", "\n  \n", "# every setting from the defaults\n"])
def test_a_config_file_with_no_settings_is_refused_rather_than_read_as_the_defaults(tmp_path,
                                                                                    text):
    # A file truncated to nothing (a failed copy, a full disk) would otherwise train the
    # embedded CPU demo under the user's experiment name.
    f = tmp_path / "exp.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError, match="holds no settings.*leave --config out"):
        config.load(f)


def test_invalid_yaml_names_the_line(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("train:\n  max_steps: 3\n  lr: [1,\n")
    with pytest.raises(ConfigError, match="bad.yaml line"):
        config.load(f)


def test_the_global_batch_must_split_over_the_world():
    cfg = config.load(None, ["train.global_batch_size=16", "train.micro_batch_size=8"])
    config.check_world_size(cfg, 2)
    with pytest.raises(ConfigError, match="world size x train.micro_batch_size"):
        config.check_world_size(cfg, 4)


def test_identity_changes_are_listed_and_limits_are_not():
    old = config.load(None)
    new = config.load(None, ["train.max_steps=999", "model.n_layer=6", "train.seed=1"])
    assert config.diff_identity(old, new) == ["model.n_layer: 4 -> 6", "train.seed: 1337 -> 1"]


@pytest.mark.parametrize("value", ["nan", ".inf", "-inf"])
def test_non_finite_numbers_are_refused(value):
    with pytest.raises(ConfigError, match="expected a finite number"):
        config.load(None, [f"train.lr={value}"])


@pytest.mark.parametrize("device,processes,gpus,ok", [
    ("auto", 2, 0, True),    # no GPU: auto trains on the CPU
    ("cpu", 4, 1, True),
    ("auto", 2, 2, True),
    ("auto", 2, 1, False),   # NCCL would refuse two ranks on one GPU
    ("cuda", 8, 4, False),
    ("cuda", 2, 0, False),   # said without `--nproc 0`, which the CLI refuses
    ("cuda", 1, 1, True),
])
def test_local_processes_need_a_gpu_each_when_training_on_cuda(device, processes, gpus, ok):
    cfg = config.load(None, [f"train.device={device}"])
    if ok:
        config.check_local_gpus(cfg, processes, gpus)
        return
    with pytest.raises(config.ConfigError) as err:
        config.check_local_gpus(cfg, processes, gpus)
    line = str(err.value)
    assert f"{processes} processes" in line and f"{gpus} " in line and "train.device=cpu" in line
    assert ("--nproc 0" not in line) and (gpus == 0 or f"--nproc {gpus}" in line)
    assert "\n" not in line


@pytest.mark.parametrize("processes,gpus,ok", [(4, 1, True), (8, 1, True), (4, 2, False),
                                               (4, 0, False), (2, 2, True)])
def test_a_tasks_own_single_gpu_is_left_to_the_ranks_comparison(processes, gpus, ok):
    """Under SLURM each task may see only the GPU it was given (--gpus-per-task=1): one visible
    GPU with several tasks on the node is no mistake there, and the trainer's check (per_task)
    lets it through to dist.check_own_gpus; `--nproc` and bench memory (all of this machine's
    GPUs seen by every process) still refuse it."""
    cfg = config.load(None, ["train.device=cuda"])
    if ok:
        config.check_local_gpus(cfg, processes, gpus, per_task=True)
    else:
        with pytest.raises(config.ConfigError):
            config.check_local_gpus(cfg, processes, gpus, per_task=True)
    if processes > gpus:
        with pytest.raises(config.ConfigError):
            config.check_local_gpus(cfg, processes, gpus)


@pytest.mark.parametrize("text,expected", [("true", "true"), ("false", "false"),
                                           ("auto", "auto")])
def test_compile_reads_yaml_booleans(text, expected):
    assert config.load(None, [f"train.compile={text}"]).train.compile == expected


def test_compile_refuses_anything_else():
    with pytest.raises(config.ConfigError, match="train.compile"):
        config.load(None, ["train.compile=maybe"])


def test_the_same_data_file_given_relative_then_absolute_is_no_identity_change(tmp_path,
                                                                              monkeypatch):
    monkeypatch.chdir(tmp_path)
    old = config.load(None, ["data.path=data/c.parquet"])
    new = config.load(None, [f"data.path={tmp_path / 'data' / 'c.parquet'}"])
    assert config.diff_identity(old, new) == []
    other = config.load(None, [f"data.path={tmp_path / 'other.parquet'}"])
    assert config.diff_identity(old, other)[0].startswith("data.path: ")


@pytest.mark.parametrize("text", ["007", "0x1F", "1.10", "1_000", "yes", "off", "12"])
def test_a_name_given_with_set_keeps_its_text_where_yaml_would_read_a_number_or_a_boolean(text):
    # --exp-name 1.10 used to name the folder 1.1 and resume the run of --exp-name 1.1.
    cfg = config.load(None, [f"run.exp_name={text}", f"data.path={text}"])
    assert (cfg.run.exp_name, cfg.data.path) == (text, text)


def test_numbers_and_words_of_other_keys_are_still_read_as_yaml():
    cfg = config.load(None, ["train.lr=1e-3", "train.max_steps=0x10", "train.compile=true",
                                 "checkpoint.interval=auto"])
    assert (cfg.train.lr, cfg.train.max_steps, cfg.train.compile,
            cfg.checkpoint.interval) == (0.001, 16, "true", "auto")
