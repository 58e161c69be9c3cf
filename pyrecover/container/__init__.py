"""The Apptainer container: `apptainer` command lines, and the definition file's checker.

`apptainer` builds command lines; `definition` checks a definition file on the line-by-line
reading of `recipe` and the %post shell reading of `shell`. Imports no torch.
"""

from pyrecover.container.apptainer import (
    APPTAINER_MISSING,
    Bind,
    ContainerError,
    build_argv,
    env_arg,
    exec_argv,
    find_apptainer,
    parse_bind,
)
from pyrecover.container.definition import check_definition, check_definition_text
from pyrecover.container.recipe import Problem

__all__ = ["APPTAINER_MISSING", "Bind", "ContainerError", "Problem", "build_argv",
           "check_definition", "check_definition_text", "env_arg", "exec_argv",
           "find_apptainer", "parse_bind"]
