#include "chat/pyjson.h"

#include "core/error.h"
#include "tokenizer/utf8.h"

#include <algorithm>

namespace perigee::chat {

namespace {

void dump_string(const std::string & s, std::string & out) {
    static const char * hex = "0123456789abcdef";
    out.push_back('"');
    for (char ch : s) {
        const auto c = static_cast<unsigned char>(ch);
        switch (c) {
            case '"': out += "\\\""; break;
            case '\\': out += "\\\\"; break;
            case '\n': out += "\\n"; break;
            case '\r': out += "\\r"; break;
            case '\t': out += "\\t"; break;
            case '\b': out += "\\b"; break;
            case '\f': out += "\\f"; break;
            default:
                if (c < 0x20) {
                    out += "\\u00";
                    out.push_back(hex[c >> 4]);
                    out.push_back(hex[c & 0xF]);
                } else {
                    out.push_back(ch);
                }
        }
    }
    out.push_back('"');
}

void dump(const json & v, bool compact, std::string & out) {
    const char * item_sep = compact ? "," : ", ";
    const char * key_sep = compact ? ":" : ": ";
    switch (v.type()) {
        case json::value_t::null: out += "null"; break;
        case json::value_t::boolean: out += v.get<bool>() ? "true" : "false"; break;
        case json::value_t::number_integer:
        case json::value_t::number_unsigned:
        case json::value_t::number_float: out += v.dump(); break;  // shortest round-trip, Python-like repr
        case json::value_t::string: dump_string(v.get_ref<const std::string &>(), out); break;
        case json::value_t::array: {
            out.push_back('[');
            bool first = true;
            for (const auto & e : v) {
                if (!first) out += item_sep;
                first = false;
                dump(e, compact, out);
            }
            out.push_back(']');
            break;
        }
        case json::value_t::object: {
            out.push_back('{');
            bool first = true;
            for (auto it = v.begin(); it != v.end(); ++it) {
                if (!first) out += item_sep;
                first = false;
                dump_string(it.key(), out);
                out += key_sep;
                dump(it.value(), compact, out);
            }
            out.push_back('}');
            break;
        }
        default: PG_FAIL("py_json_dumps: unsupported JSON value type '{}'", v.type_name());
    }
}

} // namespace

std::string py_json_dumps(const json & v, bool compact) {
    std::string out;
    dump(v, compact, out);
    return out;
}

json deep_sorted(const json & v) {
    if (v.is_object()) {
        std::vector<std::string> keys;
        for (auto it = v.begin(); it != v.end(); ++it) keys.push_back(it.key());
        std::sort(keys.begin(), keys.end());  // UTF-8 byte order == code-point order
        json out = json::object();
        for (const auto & k : keys) out[k] = deep_sorted(v.at(k));
        return out;
    }
    if (v.is_array()) {
        json out = json::array();
        for (const auto & e : v) out.push_back(deep_sorted(e));
        return out;
    }
    return v;
}

bool py_is_blank(const std::string & s) {
    size_t i = 0;
    while (i < s.size()) {
        const size_t n = tok::utf8_seq_len(s, i);
        if (n == 0) return false;
        const uint32_t c = tok::utf8_decode_at(s, i, n);
        const bool sp = (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 ||
                        c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 ||
                        c == 0x202F || c == 0x205F || c == 0x3000;
        if (!sp) return false;
        i += n;
    }
    return true;
}

} // namespace perigee::chat
