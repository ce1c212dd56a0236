// The perigee CLI is a set of subcommands; each lives in its own tools/cmd-<name>.cpp and
// registers itself here, so adding a command never edits main.cpp.
#pragma once
#include <CLI/CLI.hpp>

#include <functional>
#include <string>
#include <vector>

namespace perigee::cli {

struct command {
    std::string name;
    std::string help;
    // Adds options to `sub` and returns the function that runs the command (returns the exit code).
    std::function<std::function<int()>(CLI::App & sub)> setup;
};

std::vector<command> & command_registry();

struct command_registrar {
    explicit command_registrar(command c) { command_registry().push_back(std::move(c)); }
};

// The repository's embedded default model directory (set at build time).
std::string default_model_dir();

} // namespace perigee::cli
