//! AES-128-GCM throughput of the two codes the data links can use (see
//! `src/transport/record/aead.rs`): aws-lc sealing and opening out of place, and ring sealing
//! and opening in place after a copy, as the record layer calls them (16 KiB records).
//!
//! ```sh
//! cargo run --release --example aead_throughput -- [MIB] [REPS]
//! ```
//!
//! MIB (default 256) is the plaintext per pass: larger than the caches, as a tensor is; REPS
//! (default 3) passes per code and direction. Prints the best pass of each in GB/s.

use std::time::Instant;

const RECORD: usize = 1 << 14;
const TAG: usize = 16;

fn nonce(i: usize) -> [u8; 12] {
    let mut n = [0u8; 12];
    n[4..].copy_from_slice(&(i as u64).to_be_bytes());
    n
}

fn best(reps: usize, bytes: usize, mut pass: impl FnMut()) -> f64 {
    (0..reps)
        .map(|_| {
            let t = Instant::now();
            pass();
            bytes as f64 / t.elapsed().as_secs_f64() / 1e9
        })
        .fold(0.0, f64::max)
}

fn main() {
    let mut args = std::env::args().skip(1);
    let mib: usize = args.next().map_or(256, |a| a.parse().expect("MIB"));
    let reps: usize = args.next().map_or(3, |a| a.parse().expect("REPS"));
    let n = (mib << 20) / RECORD * RECORD;
    let records = n / RECORD;
    let plain: Vec<u8> = (0..n).map(|i| (i * 7 + 3) as u8).collect();
    let mut wire = vec![0u8; records * (RECORD + TAG)];
    let mut back = vec![0u8; n];
    let key = [7u8; 16];
    let aad = [23u8, 3, 3, 0x40, 0x11];

    let aws = {
        use aws_lc_rs::aead::*;
        LessSafeKey::new(UnboundKey::new(&AES_128_GCM, &key).expect("key"))
    };
    let seal = best(reps, n, || {
        use aws_lc_rs::aead::*;
        for (i, (p, w)) in plain
            .chunks(RECORD)
            .zip(wire.chunks_mut(RECORD + TAG))
            .enumerate()
        {
            let (c, t) = w.split_at_mut(RECORD);
            let nonce = Nonce::assume_unique_for_key(nonce(i));
            aws.seal_out_of_place_scatter(nonce, Aad::from(aad), p, c, &[], t)
                .expect("seal");
        }
    });
    let open = best(reps, n, || {
        use aws_lc_rs::aead::*;
        for (i, (w, b)) in wire
            .chunks(RECORD + TAG)
            .zip(back.chunks_mut(RECORD))
            .enumerate()
        {
            let (c, t) = w.split_at(RECORD);
            let nonce = Nonce::assume_unique_for_key(nonce(i));
            aws.open_separate_gather(nonce, Aad::from(aad), c, t, b)
                .expect("open");
        }
    });
    assert!(back == plain, "aws-lc round trip");
    println!("aead_throughput code=aws-lc mib={mib} seal_gbs={seal:.2} open_gbs={open:.2}");

    back.fill(0);
    let ring_key = {
        use ring::aead::*;
        LessSafeKey::new(UnboundKey::new(&AES_128_GCM, &key).expect("key"))
    };
    let seal = best(reps, n, || {
        use ring::aead::*;
        for (i, (p, w)) in plain
            .chunks(RECORD)
            .zip(wire.chunks_mut(RECORD + TAG))
            .enumerate()
        {
            let (c, t) = w.split_at_mut(RECORD);
            c.copy_from_slice(p);
            let nonce = Nonce::assume_unique_for_key(nonce(i));
            let tag = ring_key
                .seal_in_place_separate_tag(nonce, Aad::from(aad), c)
                .expect("seal");
            t.copy_from_slice(tag.as_ref());
        }
    });
    let open = best(reps, n, || {
        use ring::aead::*;
        for (i, (w, b)) in wire
            .chunks(RECORD + TAG)
            .zip(back.chunks_mut(RECORD))
            .enumerate()
        {
            let (c, t) = w.split_at(RECORD);
            b.copy_from_slice(c);
            let nonce = Nonce::assume_unique_for_key(nonce(i));
            let tag = Tag::try_from(t).expect("tag");
            ring_key
                .open_in_place_separate_tag(nonce, Aad::from(aad), tag, b, 0..)
                .expect("open");
        }
    });
    assert!(back == plain, "ring round trip");
    println!("aead_throughput code=ring mib={mib} seal_gbs={seal:.2} open_gbs={open:.2}");
}
