"""The Apptainer container: `apptainer` command lines, and the definition file's checker."""

from pyrecover.container.definition import (
    APPTAINER_MISSING,
    Bind,
    ContainerError,
    Problem,
    build_argv,
    check_definition,
    check_definition_text,
    env_arg,
    exec_argv,
    find_apptainer,
    parse_bind,
)

__all__ = ["APPTAINER_MISSING", "Bind", "ContainerError", "Problem", "build_argv",
           "check_definition", "check_definition_text", "env_arg", "exec_argv",
           "find_apptainer", "parse_bind"]
