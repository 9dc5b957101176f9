//! Progress bars for the library's long stages (`compressme_offline::Progress`).

use std::cell::RefCell;

use compressme::offline::Progress;
use indicatif::{ProgressBar, ProgressStyle};

/// One bar per stage; a stage's summary line goes to stderr when it ends.
pub(crate) struct Bars {
    bar: RefCell<Option<ProgressBar>>,
}

impl Bars {
    pub(crate) fn new() -> Self {
        Self {
            bar: RefCell::new(None),
        }
    }
}

impl Progress for Bars {
    fn stage(&self, name: &str, total: u64) {
        let pb = ProgressBar::new(total);
        if let Ok(style) =
            ProgressStyle::with_template("{msg:>16} {bar:30} {pos}/{len} {elapsed} (eta {eta})")
        {
            pb.set_style(style);
        }
        pb.set_message(name.to_string());
        *self.bar.borrow_mut() = Some(pb);
    }
    fn inc(&self, n: u64) {
        if let Some(pb) = self.bar.borrow().as_ref() {
            pb.inc(n);
        }
    }
    fn done(&self, summary: &str) {
        if let Some(pb) = self.bar.borrow_mut().take() {
            pb.finish_and_clear();
        }
        if !summary.is_empty() {
            eprintln!("{summary}");
        }
    }
}
