//! Fuzz target: `--from-file` bytes (read as YAML and as JSON) → model → ruleset → rendering.
//! Nothing may panic, whatever the input; what the reader accepts must build and render; JSON
//! list items read from their text read exactly as through generic values.

#![no_main]

use libfuzzer_sys::fuzz_target;
use nodeproxy::config::Config;
use nodeproxy::ruleset::{self, Settings};
use nodeproxy::source::file::{load_text, load_text_through_values};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let json = std::path::Path::new("fuzz.json");
    assert_eq!(
        format!("{:?}", load_text(json, text)),
        format!("{:?}", load_text_through_values(json, text)),
        "read from the items' text and through values differ"
    );
    for name in ["fuzz.yaml", "fuzz.json"] {
        if let Ok(loaded) = load_text(std::path::Path::new(name), text) {
            let settings = Settings::new(&Config::default(), "node-a".to_string());
            let built = ruleset::build(&loaded.state, &settings);
            let _ = ruleset::render::render(&built);
        }
    }
});
