//! Writes the hand-made fuzz seeds (`hivemesh::fuzzing::seeds`) into `fuzz/corpus/<target>/`
//! as `seed-<n>`, next to what the fuzzer keeps there. Run before a first fuzzing run:
//! `cargo run --example fuzz_seeds` (see fuzz/README.md).

use std::path::Path;

fn main() -> anyhow::Result<()> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus");
    let mut counts = std::collections::BTreeMap::<&str, usize>::new();
    for (target, input) in hivemesh::fuzzing::seeds() {
        let n = counts.entry(target).or_default();
        let dir = root.join(target);
        std::fs::create_dir_all(&dir)?;
        std::fs::write(dir.join(format!("seed-{n}")), input)?;
        *n += 1;
    }
    for (target, n) in counts {
        println!("{target}: {n} seeds");
    }
    Ok(())
}
