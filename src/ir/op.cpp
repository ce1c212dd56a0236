#include "ir/op.h"

namespace perigee {

std::string_view op_name(op_type op) {
    switch (op) {
        case op_type::IDS: return "IDS";
        case op_type::WEIGHT: return "WEIGHT";
        case op_type::STATE: return "STATE";
        case op_type::GET_ROWS: return "GET_ROWS";
        case op_type::RMS_NORM: return "RMS_NORM";
        case op_type::LAYER_NORM: return "LAYER_NORM";
        case op_type::L2_NORM: return "L2_NORM";
        case op_type::LINEAR: return "LINEAR";
        case op_type::ADD: return "ADD";
        case op_type::MUL: return "MUL";
        case op_type::SCALE: return "SCALE";
        case op_type::SIGMOID: return "SIGMOID";
        case op_type::SILU_MUL: return "SILU_MUL";
        case op_type::SITU_MUL: return "SITU_MUL";
        case op_type::COLS: return "COLS";
        case op_type::SELECT_ROWS: return "SELECT_ROWS";
        case op_type::SHORT_CONV: return "SHORT_CONV";
        case op_type::KDA_GATE: return "KDA_GATE";
        case op_type::KDA_SCAN: return "KDA_SCAN";
        case op_type::GATED_RMS_NORM: return "GATED_RMS_NORM";
        case op_type::MLA_ATTN: return "MLA_ATTN";
        case op_type::INDEXER_TOPK: return "INDEXER_TOPK";
        case op_type::MOE_ROUTE: return "MOE_ROUTE";
        case op_type::MOE_EXPERTS: return "MOE_EXPERTS";
        case op_type::ATTN_RES_MIX: return "ATTN_RES_MIX";
        case op_type::COUNT: break;
    }
    return "?";
}

} // namespace perigee
