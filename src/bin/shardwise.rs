fn main() {
    std::process::exit(shardwise::cli::run(std::env::args().collect()));
}
