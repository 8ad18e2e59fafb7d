"""What the end of an invocation measures again: a trial that passed the window-dispersion test when
it ran, against the control runs so far, and fails it against the final floor.

Why: a run that fails the test when it runs is measured again at once, in a fresh process of its
own, and is unstable only where that run is too (``search.stability.measured.again_if_dispersed``):
a burst on the machine, or one of the interpreter's slow episodes, seldom comes back at the
configuration's next run, while its own jitter does. The final floor knows more control runs, so
a run can pass then and fail at the end, when the study judges every trial again. Without a second
run there it would be judged on one run alone, by the rule the second run exists to soften: on the
2-core AMD EPYC one of the two compute-bound false alarms of an idle record of 96 runs
(``coverage_by_kind-2026-11-27-idle-confirmed.json``) came so. Each costs one trial's time, and
only where the final floor changed the verdict.

Only a trial whose verdict can still move the front is measured again: with re-validation on, the
front a study ends with reads re-validated configurations alone
(``search.revalidation.candidates.final_front``), so a trial that was not re-validated is measured
again only where no re-validated one is judged yet (a study cut short). Before, every dispersed
trial was, and its time changed a label and nothing the study recommends.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping
from dataclasses import replace

from search.core.records import TrialRecord
from search.execution.isolation import run_isolated
from search.revalidation.candidates import final_front
from search.revalidation.pooling import Pooled
from search.stability.measured import again_if_dispersed
from search.storage.repeat_runs import judged_revalidations, study_revalidations
from search.storage.trial_store import save_late_second, second_of
from search.study.driver import StudyDriver

__all__ = ["dispersed_at_the_end"]


def dispersed_at_the_end(driver: StudyDriver, numbers: Collection[int]) -> list[int]:
    """Measure again, each in a fresh process, the trials among ``numbers`` (this invocation's)
    that the floor as it stands now calls unstable for their window dispersion first, that have
    no second process yet, nor re-validated figures (judged on their own fresh runs), and that
    would be on the study's final front if stable (``_could_move_the_front``); keep what it
    measured in the study (``save_late_second``), where judging the trial reads it. Returns the
    numbers measured again."""
    study = driver.study
    attrs = study.user_attrs
    has_second = set(study_revalidations(study, driver.fingerprint)) | {
        t.number for t in study.get_trials(deepcopy=False) if second_of(t, attrs)
    }
    history = driver.history()
    done = judged_revalidations(study, driver.fingerprint, driver.settings)
    again = []
    for record in history:
        if record.number not in numbers or record.number in has_second:
            continue
        if not _could_move_the_front(driver, record, history, done):
            continue
        started = time.monotonic()
        second = again_if_dispersed(driver.request(record.config), record, run_isolated)
        driver.new_s += time.monotonic() - started
        if second is not None:
            save_late_second(study, record.number, second)
            again.append(record.number)
    return again


def _could_move_the_front(
    driver: StudyDriver,
    record: TrialRecord,
    history: list[TrialRecord],
    done: Mapping[int, Pooled],
) -> bool:
    """Whether ``record``, were it stable, would be on the front the study ends with."""
    if record.stable:
        return False  # not dispersed: again_if_dispersed would measure nothing
    steady = [replace(r, stable=True) if r.number == record.number else r for r in history]
    front = final_front(steady, done, driver.settings, driver.space)
    return any(r.number == record.number for r in front)
