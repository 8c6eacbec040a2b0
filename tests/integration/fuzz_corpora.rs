//! Replays the fuzz corpora (`fuzz/corpus/<target>/`, what cargo-fuzz kept, including the
//! inputs of fixed crashes) and the hand-made seeds through the same entry points the fuzz
//! targets call (`hivemesh::fuzzing`), so that `cargo test` catches a decoder that regresses
//! on any input the fuzzer ever found interesting. A target whose corpus went missing fails.

use std::path::Path;

#[test]
fn every_fuzz_target_replays_its_corpus() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz");
    for (target, run) in hivemesh::fuzzing::TARGETS {
        assert!(
            root.join("fuzz_targets")
                .join(format!("{target}.rs"))
                .is_file(),
            "fuzz/fuzz_targets/{target}.rs is missing"
        );
        let dir = root.join("corpus").join(target);
        let mut inputs: Vec<_> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .map(|entry| entry.expect("corpus entry").path())
            .collect();
        inputs.sort();
        assert!(!inputs.is_empty(), "{} is empty", dir.display());
        for path in &inputs {
            let bytes = std::fs::read(path).expect("corpus file");
            run(&bytes);
        }
        eprintln!("{target}: {} corpus inputs", inputs.len());
    }
}

#[test]
fn the_seeds_run_and_cover_every_target() {
    let seeds = hivemesh::fuzzing::seeds();
    for (target, run) in hivemesh::fuzzing::TARGETS {
        let mine: Vec<_> = seeds.iter().filter(|(t, _)| t == target).collect();
        assert!(!mine.is_empty(), "no seed for {target}");
        for (_, input) in mine {
            run(input);
        }
    }
}
