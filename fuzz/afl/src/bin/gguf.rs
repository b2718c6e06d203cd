//! AFL++ harness for kvq-fuzz's `gguf` target.

fn main() {
    kvq_afl::fuzz("gguf");
}
