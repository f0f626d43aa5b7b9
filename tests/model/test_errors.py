"""Every user-facing trainer error is a `TrainerError` and keeps the builtin base it had before."""

from __future__ import annotations

import pytest

from trainer.config import ConfigError
from trainer.config.validation import NotUtf8Error
from trainer.data.errors import InputError
from trainer.data.lengths import LengthsError
from trainer.data.store import StoreError, StoreExistsError
from trainer.errors import ExitCode, TrainerError
from trainer.eval_prompts import PromptError
from trainer.kernels.common import BackendUnavailableError, KernelInputError
from trainer.memory.shapes import MemoryEstimateError
from trainer.model.errors import ExportError, TargetError
from trainer.model.mask_token import MaskTokenError


@pytest.mark.parametrize(
    ("cls", "builtin"),
    [
        (ConfigError, ValueError),
        (NotUtf8Error, ValueError),
        (InputError, Exception),
        (LengthsError, ValueError),
        (StoreError, Exception),
        (StoreExistsError, FileExistsError),
        (PromptError, ValueError),
        (KernelInputError, ValueError),
        (BackendUnavailableError, RuntimeError),
        (MemoryEstimateError, ValueError),
        (ExportError, ValueError),
        (MaskTokenError, ValueError),
        (TargetError, ValueError),
    ],
)
def test_user_errors_share_the_trainer_base(
    cls: type[TrainerError], builtin: type[Exception]
) -> None:
    assert issubclass(cls, TrainerError) and issubclass(cls, builtin)
    assert cls.exit_code is ExitCode.USAGE


def test_hint_is_keyword_only_and_optional() -> None:
    err = ConfigError("run.toml: model.lr: must be > 0", hint="set model.lr = 3e-4")
    assert str(err) == "run.toml: model.lr: must be > 0"
    assert err.one_line() == "run.toml: model.lr: must be > 0 (hint: set model.lr = 3e-4)"
    assert TargetError("no config.json").one_line() == "no config.json"
