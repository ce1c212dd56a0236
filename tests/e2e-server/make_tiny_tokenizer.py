#!/usr/bin/env python3
"""Writes a tiny K3-style tokenizer into DIR: tiktoken.model with the 256 single bytes (ranks in
GPT-2 bytes_to_unicode order, TOKENIZER §2.1) and tokenizer_config.json naming the K3 special
tokens at their K3 offsets after the ranks (TOKENIZER §2.3: [BOS]=256, [EOS]=257,
<|end_of_msg|>=258, <|open|>=259, ...). n_vocab = 512, so the model needs vocab_size >= 512
(`perigee synth --preset k3-tiny-v512`)."""
import base64, json, os, sys

def byte_order():
    printable = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    rest = [b for b in range(256) if b not in printable]
    return printable + rest

K3 = {0: "[BOS]", 1: "[EOS]", 2: "<|end_of_msg|>", 3: "<|open|>", 4: "<|close|>", 5: "<|sep|>",
      6: "[start_header_id]", 7: "[end_header_id]", 9: "[EOT]", 18: "<|media_begin|>",
      19: "<|media_content|>", 20: "<|media_end|>", 21: "<|media_pad|>", 65: "<osagent_mode>",
      254: "[UNK]", 255: "[PAD]"}
NOT_SPECIAL = {"<|open|>", "<|close|>", "<|sep|>"}

def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "tiktoken.model"), "w") as f:
        for rank, b in enumerate(byte_order()):
            f.write(f"{base64.b64encode(bytes([b])).decode()} {rank}\n")
    atd = {str(256 + off): {"content": name, "lstrip": False, "normalized": False, "rstrip": False,
                            "single_word": False, "special": name not in NOT_SPECIAL}
           for off, name in K3.items()}
    cfg = {"tokenizer_class": "TikTokenTokenizer", "bos_token": "[BOS]", "eos_token": "[EOS]",
           "unk_token": "[UNK]", "pad_token": "[PAD]", "added_tokens_decoder": atd,
           "additional_special_tokens": ["<|end_of_msg|>", "[start_header_id]", "[end_header_id]", "[EOT]",
                                         "<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>",
                                         "<osagent_mode>"]}
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=1)

if __name__ == "__main__":
    main()
