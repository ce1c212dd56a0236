// perigee: the command-line tool. Errors become an exit code and a message here (STYLE §3.6);
// library code only throws perigee::error.
#include "command.h"
#include "core/error.h"

#include <algorithm>
#include <cstdio>

namespace perigee::cli {

std::vector<command> & command_registry() {
    static std::vector<command> r;
    return r;
}

std::string default_model_dir() { return PERIGEE_DEFAULT_MODEL; }

} // namespace perigee::cli

int main(int argc, char ** argv) {
    using namespace perigee::cli;
    CLI::App app{"perigee: an inference engine for the Kimi K3 family"};
    app.require_subcommand(1);
    auto & reg = command_registry();
    std::sort(reg.begin(), reg.end(), [](const command & a, const command & b) { return a.name < b.name; });
    std::function<int()> run;
    for (auto & c : reg) {
        CLI::App * sub = app.add_subcommand(c.name, c.help);
        auto fn = c.setup(*sub);
        sub->callback([&run, fn] { run = fn; });
    }
    try {
        app.parse(argc, argv);
    } catch (const CLI::ParseError & e) {
        return app.exit(e);
    }
    try {
        return run ? run() : 0;
    } catch (const perigee::error & e) {
        std::fprintf(stderr, "perigee: error: %s\n", e.what());
        return 1;
    } catch (const std::exception & e) {
        std::fprintf(stderr, "perigee: error: %s\n", e.what());
        return 1;
    }
}
