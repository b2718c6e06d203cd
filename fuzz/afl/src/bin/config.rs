//! AFL++ harness for kvq-fuzz's `config` target.

fn main() {
    kvq_afl::fuzz("config");
}
