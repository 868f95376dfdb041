"""The environment variable names that DejaVu's settings root understands, derived from its fields."""

from __future__ import annotations

from pydantic import BaseModel
from pydantic_settings import BaseSettings


def _model_class(annotation: object) -> type[BaseModel] | None:
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def env_names(root: type[BaseSettings]) -> set[str]:
    """Every ``PREFIX + FIELD(__FIELD)*`` name that sets a field of ``root``, in upper case.

    Sub-models count too: pydantic-settings parses ``DEJAVU_REDIS`` as a JSON object for the whole model.
    """
    prefix = str(root.model_config.get("env_prefix", "")).upper()
    delimiter = str(root.model_config.get("env_nested_delimiter") or "__")
    names: set[str] = set()

    def walk(model: type[BaseModel], path: str) -> None:
        for field_name, field in model.model_fields.items():
            name = f"{path}{field_name.upper()}"
            names.add(name)
            sub = _model_class(field.annotation)
            if sub is not None:
                walk(sub, name + delimiter)

    walk(root, prefix)
    return names
