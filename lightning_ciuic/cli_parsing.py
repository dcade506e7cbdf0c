"""Reading a run's config as ``lightning-ciuic`` reads it: the parser and the one-line refusals, without the commands.

Contract: below both the console script (:mod:`lightning_ciuic.cli`, which runs ``fit`` and the pack's commands) and
the planner (:mod:`lightning_ciuic.planner.config`, which reads a config without a Trainer), so each builds on the
very same parsing and neither imports the other's side.

* :data:`CONFIG_MODE`: a config file is YAML (or JSON), or TOML where its name ends in ``.toml``
  (:func:`load_config_text`; registered with jsonargparse on import).
* :class:`PackArgumentParser`: Lightning's parser in that mode; a bad ``communication_compression`` is said as the
  choices and what was given (:func:`compression_error`), instead of jsonargparse's error for each member of the
  argument's ``Union[CompressionMode, GradientQuantizer]``.
* :class:`ConfigCLI`: ``LightningCLI`` with that parser, where a class that refuses the config's arguments is a
  :class:`ConfigError` (a ``ValueError``) saying that refusal, one line (:func:`instantiation_error`).
"""

from __future__ import annotations

import re
from typing import Any, Callable, NoReturn, Optional

import jsonargparse
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI


CONFIG_MODE = "yaml_or_toml"  # the parsers' mode: YAML (JSON is YAML), TOML for a file whose name ends in .toml


def _toml_loads() -> tuple[Callable[[str], Any], type[Exception]]:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import toml as tomllib  # type: ignore[no-redef]

        return tomllib.loads, tomllib.TomlDecodeError
    return tomllib.loads, tomllib.TOMLDecodeError


def load_config_text(text: str, path: Any = "") -> Any:
    """A config's text as a Python value: TOML where ``path`` ends in ``.toml``, else jsonargparse's YAML loader (every
    value given on the command line too)."""
    if str(path).lower().endswith(".toml"):
        return _toml_loads()[0](text)
    return jsonargparse.get_loader("yaml")(text)


def _register_config_mode() -> None:
    import yaml

    jsonargparse.set_loader(CONFIG_MODE, load_config_text, (yaml.YAMLError, _toml_loads()[1]))


_register_config_mode()


class ConfigError(ValueError):
    """The config's classes could not be built from it: the refusal, as one message (see :func:`instantiation_error`)."""


def instantiation_error(message: str) -> str:
    """jsonargparse's ``message`` about a class it could not build, or, where it wraps one refusal in its list of every
    type the value could have been ("Does not validate against any of the Union subtypes ... - Expected a <class
    'NoneType'>", or ``str`` for a strategy given by name), that refusal alone."""
    lines = message.splitlines()
    if "Errors:" not in lines:
        return message
    items: list[list[str]] = []
    for line in lines[lines.index("Errors:") + 1:]:
        if line.startswith("  - "):
            items.append([line[4:]])
        elif line.startswith("    ") and items:
            items[-1].append(line.strip())
        else:
            break
    refusals = [" ".join(item) for item in items if not item[0].startswith("Expected a <class ")]
    return refusals[0] if len(refusals) == 1 else message


_PARSER_KEY = re.compile(r'Parser key "([^"]+)":')
_GIVEN = re.compile(r"Given value type: <class '([^']+)'>\n\s*Given value: ([^\n]*)")
_QUANTIZER_PROBLEM = re.compile(r"Problem with given class_path '[\w.]*GradientQuantizer':\n(.*?)\n\s*Given value type", re.S)


def compression_error(message: str) -> str:
    """jsonargparse's ``message``, or, where it is about ``communication_compression``, what was given and the choices."""
    from lightning_ciuic.comm.compression import COMPRESSION_MODES
    from lightning_ciuic.comm.hooks import GradientQuantizer

    keys = list(_PARSER_KEY.finditer(message))
    at = next((i for i, key in enumerate(keys) if key.group(1).split(".")[-1] == "communication_compression"), None)
    if at is None:
        return message
    block = message[keys[at].start():]
    given = _GIVEN.search(block)
    if given is None:
        return message
    kind, value = given.groups()
    name = ".".join(key.group(1) for key in keys[: at + 1])  # "trainer.strategy" + "communication_compression"
    shown = repr(value) if kind == "str" else value
    problem = _QUANTIZER_PROBLEM.search(block) if kind != "str" else None
    why = ""
    if problem is not None:
        why = " (the GradientQuantizer given: " + "; ".join(line.strip() for line in problem.group(1).splitlines() if line.strip()) + ")"
    *most, last = sorted(GradientQuantizer.MODES, reverse=True)
    bits = f"{', '.join(str(b) for b in most)} or {last}"
    return (
        f"{name}={shown} is not one of {', '.join(repr(m) for m in COMPRESSION_MODES)}, nor a GradientQuantizer{why}."
        f" Give one of those, or a GradientQuantizer: --{name} GradientQuantizer --{name}.bits 8 (bits {bits};"
        " in YAML: class_path: lightning_ciuic.GradientQuantizer, init_args: {bits: 8})."
    )


class PackArgumentParser(LightningArgumentParser):
    """Lightning's parser, reading TOML config files too (:data:`CONFIG_MODE`), with the errors about
    ``communication_compression`` said as :func:`compression_error` says."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("parser_mode", CONFIG_MODE)
        super().__init__(*args, **kwargs)

    def add_argument(self, *args: Any, **kwargs: Any) -> Any:
        if "--config" in args and isinstance(kwargs.get("action"), type) and issubclass(kwargs["action"], jsonargparse.ActionConfigFile):
            kwargs["help"] = "Path to a configuration file: YAML or JSON, or TOML where its name ends in .toml."
        return super().add_argument(*args, **kwargs)

    def error(self, message: str, ex: Optional[Exception] = None) -> NoReturn:
        # Only where the message is printed: a class's own parser (exit_on_error=False) raises it to the outer one,
        # whose message holds the whole path of keys.
        super().error(compression_error(message) if self.exit_on_error else message, ex)


class ConfigCLI(LightningCLI):
    """LightningCLI whose parser is :class:`PackArgumentParser` and whose refusals are :class:`ConfigError` s."""

    def __init__(self, *args: Any, parser_class: type[LightningArgumentParser] = PackArgumentParser, **kwargs: Any) -> None:
        super().__init__(*args, parser_class=parser_class, **kwargs)

    def instantiate_classes(self) -> None:
        """Lightning's; a class that refuses the config's arguments is a :class:`ConfigError` saying that refusal."""
        try:
            super().instantiate_classes()
        except ValueError as err:
            raise ConfigError(instantiation_error(str(err))) from err
