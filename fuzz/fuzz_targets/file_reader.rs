//! Fuzz target: `--from-file` bytes (read as YAML and as JSON) → model → ruleset → rendering.
//! Nothing may panic, whatever the input; what the reader accepts must build and render.

#![no_main]

use libfuzzer_sys::fuzz_target;
use nodeproxy::config::Config;
use nodeproxy::ruleset::{self, Settings};
use nodeproxy::source::file::load_text;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    for name in ["fuzz.yaml", "fuzz.json"] {
        if let Ok(loaded) = load_text(std::path::Path::new(name), text) {
            let settings = Settings::new(&Config::default(), "node-a".to_string());
            let built = ruleset::build(&loaded.state, &settings);
            let _ = ruleset::render::render(&built);
        }
    }
});
