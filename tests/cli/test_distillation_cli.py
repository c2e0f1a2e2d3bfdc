"""``rl.distillation`` from the command line: the teacher's engines in ``skyrl rl --dry-run``, a
teacher of another vocabulary refused by ``skyrl recipes validate``, and the teacher's engines in an
engine pool's plan (``skyrl engines up --dry-run``)."""

from __future__ import annotations

import json

from tests.unit.test_distillation import VOCAB, model_dir


def write(tmp_path, teacher_vocab=VOCAB, extra=""):
    model_dir(tmp_path / "student", VOCAB)
    model_dir(tmp_path / "teacher", teacher_vocab)
    path = tmp_path / "distill.toml"
    path.write_text(
        'name = "distill"\n[model]\ninit = {}\ntokenizer = "char"\n[data]\ntask = "addition"\n'
        '[rl]\ninit_from = "student"\n[rl.distillation]\nteacher = "teacher"\nengines = 2\n'
        f'task_reward = false\ndtype = "float32"\n{extra}[inference]\nengines = 1\n[trainer]\ndevice = "cpu"\n'
    )
    return path


def test_dry_run_shows_the_teacher_engines(skyrl, tmp_path):
    result = skyrl("rl", write(tmp_path), "--dry-run", "--json", "--pool", "none", "--run-dir", tmp_path / "run")
    assert result.code == 0, result.err
    plan = json.loads(result.out)
    teachers = [p for p in plan["processes"] if p["role"] == "auxiliary"]
    assert [p["name"] for p in teachers] == ["teacher-0", "teacher-1"]
    for p in teachers:
        assert p["argv"][3] == str(tmp_path / "teacher")
        assert p["argv"][p["argv"].index("--dtype") + 1] == "float32"
    assert len(plan["auxiliary_urls"]["teacher"]) == 2
    orchestrator = next(p for p in plan["processes"] if p["role"] == "orchestrator")
    urls = ",".join(plan["auxiliary_urls"]["teacher"])
    assert orchestrator["argv"][orchestrator["argv"].index("--auxiliary-urls") + 1] == f"teacher={urls}"


def test_validate_refuses_a_teacher_with_another_vocabulary(skyrl, tmp_path):
    path = write(tmp_path, {**VOCAB, "zz": 9})
    result = skyrl("recipes", "validate", path)
    assert result.code == 2
    assert (
        f"{path}:10: rl.distillation.teacher: not the policy's tokenizer: vocabularies differ: 5 tokens in "
        in result.err
    )
    assert str(tmp_path / "student") in result.err and str(tmp_path / "teacher") in result.err


def test_an_engine_pool_of_the_recipe_holds_the_teachers_engines(skyrl, tmp_path):
    result = skyrl("engines", "up", write(tmp_path), "--dry-run", "--json", "--no-warm")
    assert result.code == 0, result.err
    plan = json.loads(result.out)
    teachers = [p for p in plan["processes"] if p["role"] == "auxiliary"]
    assert [p["name"] for p in teachers] == ["teacher-0", "teacher-1"]
    assert all("SKYRL_DIE_WITH_PARENT" not in p["env"] for p in teachers)  # they outlive the command
    assert len(plan["auxiliary_urls"]["teacher"]) == 2
