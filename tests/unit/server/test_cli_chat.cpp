// CLI tests on the shipped default model (models/default, a small K3 trained on Shakespeare):
//  * `perigee chat` non-interactive (stdin not a TTY): two user lines piped in, greedy; each turn
//    produces text, no U+FFFD anywhere, and each turn ended on the chat template's end-of-message
//    token (checked through --debug-ids, which reports the last generated id and its text).
//  * `perigee generate --prompt "ROMEO:" --raw -n 40` prints text without U+FFFD.
// Each checker has a control that must fail on a perturbed output.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <unistd.h>
#include <vector>

namespace fs = std::filesystem;

namespace {

struct run_result {
    int rc = -1;
    std::string out, err;
};

std::string slurp(const fs::path & p) {
    std::ifstream f(p, std::ios::binary);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
}

// Runs the perigee binary with `args` (shell words), stdin from `input`; captures stdout/stderr.
run_result run_perigee(const std::string & args, const std::string & input) {
    const fs::path dir = fs::temp_directory_path() / ("perigee_cli_" + std::to_string(::getpid()));
    fs::create_directories(dir);
    {
        std::ofstream in(dir / "in.txt", std::ios::binary);
        in << input;
    }
    const std::string cmd = std::string("OMP_WAIT_POLICY=PASSIVE NO_COLOR=1 '") + PERIGEE_BIN + "' " + args + " < '" +
                            (dir / "in.txt").string() + "' > '" + (dir / "out.txt").string() + "' 2> '" +
                            (dir / "err.txt").string() + "'";
    run_result r;
    const int st = std::system(cmd.c_str());
    r.rc = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    r.out = slurp(dir / "out.txt");
    r.err = slurp(dir / "err.txt");
    fs::remove_all(dir);
    return r;
}

// "" when `s` is valid UTF-8 with no U+FFFD replacement character; else what is wrong.
std::string text_problem(const std::string & s) {
    if (s.find("\xEF\xBF\xBD") != std::string::npos) return "contains U+FFFD at byte " + std::to_string(s.find("\xEF\xBF\xBD"));
    for (size_t i = 0; i < s.size();) {
        const auto c = static_cast<unsigned char>(s[i]);
        const int n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
        if (n == 0 || i + size_t(n) > s.size()) return "invalid UTF-8 at byte " + std::to_string(i);
        for (int k = 1; k < n; ++k)
            if ((static_cast<unsigned char>(s[i + size_t(k)]) & 0xC0) != 0x80) return "invalid UTF-8 at byte " + std::to_string(i);
        i += size_t(n);
    }
    return "";
}

int count_letters(const std::string & s) {
    int n = 0;
    for (unsigned char c : s) n += std::isalpha(c) ? 1 : 0;
    return n;
}

struct turn_info {
    int generated = 0, content_bytes = 0;
    std::string finish, last_text, end_of_msg;
};

// Parses the `[debug] turn N: ...` lines of --debug-ids.
std::vector<turn_info> parse_debug(const std::string & err) {
    std::vector<turn_info> turns;
    std::istringstream ss(err);
    std::string line;
    const std::regex re(R"(^\[debug\] turn \d+: prompt_tokens=\d+ generated=(\d+) finish=(\w+) last_token=-?\d+ )"
                        R"(last_token_text=(\S*) end_of_msg=(\w+) content_bytes=(\d+) )");
    while (std::getline(ss, line)) {
        std::smatch m;
        if (!std::regex_search(line, m, re)) continue;
        turn_info t;
        t.generated = std::stoi(m[1]);
        t.finish = m[2];
        t.last_text = m[3];
        t.end_of_msg = m[4];
        t.content_bytes = std::stoi(m[5]);
        turns.push_back(t);
    }
    return turns;
}

// "" when the turn produced text and ended on the end-of-message token.
std::string turn_problem(const turn_info & t) {
    if (t.generated <= 0) return "no tokens generated";
    if (t.content_bytes <= 0) return "no answer text";
    if (t.finish != "stop") return "finish=" + t.finish;
    if (t.last_text != "<|end_of_msg|>") return "ended on '" + t.last_text + "', not <|end_of_msg|>";
    if (t.end_of_msg != "yes") return "the output parser did not see the end of the message";
    return "";
}

bool have_default_model() { return fs::exists(fs::path(PERIGEE_REPO_ROOT) / "models/default/tiktoken.model"); }

} // namespace

TEST(cli_checkers, controls_fail_on_perturbed_output) {
    EXPECT_EQ(text_problem("plain text, caf\xC3\xA9"), "");
    EXPECT_NE(text_problem("bad \xEF\xBF\xBD here"), "");   // U+FFFD
    EXPECT_NE(text_problem("cut \xC3"), "");                  // cut code point
    turn_info ok{10, 20, "stop", "<|end_of_msg|>", "yes"};
    EXPECT_EQ(turn_problem(ok), "");
    turn_info t = ok;
    t.last_text = "[EOS]";
    EXPECT_NE(turn_problem(t), "");
    t = ok;
    t.finish = "length";
    EXPECT_NE(turn_problem(t), "");
    t = ok;
    t.content_bytes = 0;
    EXPECT_NE(turn_problem(t), "");
    EXPECT_EQ(parse_debug("[debug] turn 1: prompt_tokens=3 generated=2 finish=stop last_token=7 last_token_text=x "
                          "end_of_msg=no content_bytes=4 reasoning_bytes=0 seconds=0.1 ids=1,7\n").size(), 1u);
}

TEST(cli_chat, two_piped_turns_end_on_end_of_msg) {
    if (!have_default_model()) GTEST_SKIP() << "models/default is not in this checkout";
    const run_result r = run_perigee(std::string("chat --model '") + PERIGEE_REPO_ROOT + "/models/default' --temperature 0 "
                                     "--debug-ids -n 120",
                                     "Who art thou, good sir?\nWhat news from Verona?\n");
    ASSERT_EQ(r.rc, 0) << r.err;
    const auto turns = parse_debug(r.err);
    ASSERT_EQ(turns.size(), 2u) << r.err;
    for (size_t i = 0; i < turns.size(); ++i) EXPECT_EQ(turn_problem(turns[i]), "") << "turn " << i + 1 << "\n" << r.err;
    EXPECT_EQ(text_problem(r.out), "") << r.out;
    EXPECT_GT(count_letters(r.out), 20) << r.out;
    EXPECT_EQ(r.out.find("<|"), std::string::npos) << "markers leaked into the answer: " << r.out;
    EXPECT_EQ(r.out.find('\x1b'), std::string::npos) << "colour despite NO_COLOR / a pipe";
}

TEST(cli_chat, commands_reset_exit_and_system) {
    if (!have_default_model()) GTEST_SKIP() << "models/default is not in this checkout";
    // /reset forgets the history: the same question after a reset gives the same greedy answer
    // as the first time; /exit stops before the last line.
    const run_result r = run_perigee(std::string("chat --model '") + PERIGEE_REPO_ROOT + "/models/default' --thinking off "
                                     "--system 'You are Hamlet.' --debug-ids -n 60",
                                     "Speak.\n/reset\nSpeak.\n/exit\nThis line is never read.\n");
    ASSERT_EQ(r.rc, 0) << r.err;
    const auto turns = parse_debug(r.err);
    ASSERT_EQ(turns.size(), 2u) << r.err;
    std::vector<std::string> ids;
    std::istringstream ss(r.err);
    std::string line;
    while (std::getline(ss, line))
        if (line.rfind("[debug] turn", 0) == 0) ids.push_back(line.substr(line.find(" ids=")));
    ASSERT_EQ(ids.size(), 2u);
    EXPECT_EQ(ids[0], ids[1]) << "after /reset the same question must give the same greedy answer";
    EXPECT_EQ(text_problem(r.out), "");
}

TEST(cli_generate, raw_romeo_prints_clean_text) {
    if (!have_default_model()) GTEST_SKIP() << "models/default is not in this checkout";
    const run_result r = run_perigee(std::string("generate --model '") + PERIGEE_REPO_ROOT + "/models/default' --prompt 'ROMEO:' --raw -n 40", "");
    ASSERT_EQ(r.rc, 0) << r.err;
    EXPECT_EQ(text_problem(r.out), "") << r.out;
    EXPECT_GT(count_letters(r.out), 10) << r.out;
}
