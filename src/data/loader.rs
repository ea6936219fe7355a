//! The loader thread: prepares the next batches while the device trains.
//!
//! The loader owns a fixed set of slots (pinned host memory on CUDA, plain memory on the
//! CPU). It takes a free slot, writes batch `k` into it in the packed layout of the step's
//! inputs, and hands it over; the trainer gives the slot back once the step that used it
//! has finished. With four slots the loader is up to two batches ahead of the step being
//! issued, so reading, parsing or generating data never stalls a step unless it is
//! slower than the step itself (the time the trainer waited is counted: [`Loader::stalled`]).

use std::ops::{Deref, DerefMut};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Result};
use erase_runtime::cuda::feed::PinnedBuffer;

/// A slot's memory.
pub enum SlotMem {
    Host(Vec<u8>),
    Pinned(PinnedBuffer),
}

impl Deref for SlotMem {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            SlotMem::Host(v) => v,
            SlotMem::Pinned(p) => p,
        }
    }
}

impl DerefMut for SlotMem {
    fn deref_mut(&mut self) -> &mut [u8] {
        match self {
            SlotMem::Host(v) => v,
            SlotMem::Pinned(p) => p,
        }
    }
}

/// A filled slot: batch `batch` in slot `slot`.
pub struct Filled {
    pub slot: usize,
    pub batch: u64,
    pub mem: SlotMem,
}

type Fill = Box<dyn FnMut(u64, &mut [u8]) -> Result<()> + Send>;

pub struct Loader {
    ready: Receiver<Result<Filled>>,
    free: Option<Sender<(usize, SlotMem)>>,
    handle: Option<JoinHandle<Vec<SlotMem>>>,
    /// Time the trainer waited for a batch.
    pub stalled: Duration,
    /// Batches handed over.
    pub batches: u64,
}

impl Loader {
    /// Starts the thread: it fills batches `first, first + 1, ...` into `slots` with
    /// `fill(k, bytes)`, in order. An error stops the thread; [`Loader::next_batch`] returns it.
    pub fn start(slots: Vec<SlotMem>, first: u64, mut fill: Fill) -> Result<Loader> {
        let (free_tx, free_rx) = channel::<(usize, SlotMem)>();
        let (ready_tx, ready_rx) = channel::<Result<Filled>>();
        for (i, m) in slots.into_iter().enumerate() {
            free_tx
                .send((i, m))
                .map_err(|_| anyhow!("the loader's slot queue closed"))?;
        }
        let handle = std::thread::Builder::new()
            .name("erase-loader".into())
            .spawn(move || {
                erase_runtime::cuda::nvtx::name_os_thread("erase-loader");
                let mut k = first;
                let mut kept = Vec::new();
                while let Ok((slot, mut mem)) = free_rx.recv() {
                    match fill(k, &mut mem) {
                        Ok(()) => {
                            if let Err(back) = ready_tx.send(Ok(Filled {
                                slot,
                                batch: k,
                                mem,
                            })) {
                                if let Ok(f) = back.0 {
                                    kept.push(f.mem);
                                }
                                break;
                            }
                            k += 1;
                        }
                        Err(e) => {
                            kept.push(mem);
                            let _ = ready_tx.send(Err(e.context(format!("preparing batch {k}"))));
                            break;
                        }
                    }
                }
                // the slots still here go back to the owner, which frees them where the
                // device's context is current
                kept.extend(std::iter::from_fn(|| free_rx.try_recv().ok().map(|x| x.1)));
                kept
            })
            .map_err(|e| anyhow!("starting the loader thread: {e}"))?;
        Ok(Loader {
            ready: ready_rx,
            free: Some(free_tx),
            handle: Some(handle),
            stalled: Duration::ZERO,
            batches: 0,
        })
    }

    /// The next batch, in order; waits if the loader is behind.
    pub fn next_batch(&mut self) -> Result<Filled> {
        let t0 = Instant::now();
        let f = self
            .ready
            .recv()
            .map_err(|_| anyhow!("the loader thread stopped"))??;
        self.stalled += t0.elapsed();
        self.batches += 1;
        Ok(f)
    }

    /// Hands a slot back to be filled again.
    pub fn give_back(&mut self, slot: usize, mem: SlotMem) {
        if let Some(tx) = &self.free {
            // a stopped thread has reported its error through `next_batch` already
            let _ = tx.send((slot, mem));
        }
    }
}

impl Drop for Loader {
    fn drop(&mut self) {
        self.free = None;
        if let Some(h) = self.handle.take() {
            // the thread ends once its free queue is closed; its slots drop here
            let _ = h.join();
        }
        while self.ready.try_recv().is_ok() {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host_slots(n: usize, bytes: usize) -> Vec<SlotMem> {
        (0..n).map(|_| SlotMem::Host(vec![0; bytes])).collect()
    }

    #[test]
    fn batches_come_in_order_through_recycled_slots() {
        let fill = |k: u64, out: &mut [u8]| -> Result<()> {
            out.copy_from_slice(&k.to_le_bytes());
            Ok(())
        };
        let mut l = Loader::start(host_slots(3, 8), 5, Box::new(fill)).unwrap();
        let mut seen = std::collections::BTreeSet::new();
        for want in 5..25u64 {
            let f = l.next_batch().unwrap();
            assert_eq!(f.batch, want);
            let got = u64::from_le_bytes(f.mem[..8].try_into().unwrap());
            assert_eq!(got, want, "slot {} holds batch {got}", f.slot);
            seen.insert(f.slot);
            l.give_back(f.slot, f.mem);
        }
        assert_eq!(seen.len(), 3, "every slot is used");
        assert_eq!(l.batches, 20);
    }

    #[test]
    fn a_failing_batch_is_reported_with_its_number() {
        let fill = |k: u64, _: &mut [u8]| -> Result<()> {
            if k == 3 {
                anyhow::bail!("line 77 of part-3.tsv: 14 fields, expected 40");
            }
            Ok(())
        };
        let mut l = Loader::start(host_slots(2, 4), 0, Box::new(fill)).unwrap();
        for _ in 0..3 {
            let f = l.next_batch().unwrap();
            l.give_back(f.slot, f.mem);
        }
        let e = format!("{:#}", l.next_batch().err().expect("batch 3 fails"));
        assert!(e.contains("batch 3") && e.contains("line 77"), "{e}");
        assert!(l.next_batch().is_err(), "the loader stays stopped");
    }

    #[test]
    fn the_loader_is_ahead_and_stops_when_dropped() {
        let (tx, rx) = std::sync::mpsc::channel();
        let fill = move |k: u64, _: &mut [u8]| -> Result<()> {
            let _ = tx.send(k);
            Ok(())
        };
        let mut l = Loader::start(host_slots(4, 1), 0, Box::new(fill)).unwrap();
        let f = l.next_batch().unwrap();
        // without any slot given back, the thread fills all four and waits
        let filled: Vec<u64> = (0..4).map(|_| rx.recv().unwrap()).collect();
        assert_eq!(filled, vec![0, 1, 2, 3]);
        drop(f);
        drop(l); // must not hang
    }
}
