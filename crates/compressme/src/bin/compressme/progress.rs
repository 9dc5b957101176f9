//! Progress bars for the library's long stages (`compressme_offline::Progress`).

use std::sync::Mutex;

use compressme::offline::Progress;
use indicatif::{ProgressBar, ProgressStyle};

/// One bar per stage; a stage's summary line goes to stderr when it ends.
pub(crate) struct Bars {
    bar: Mutex<Option<ProgressBar>>,
}

impl Bars {
    pub(crate) fn new() -> Self {
        Self {
            bar: Mutex::new(None),
        }
    }

    fn bar(&self) -> std::sync::MutexGuard<'_, Option<ProgressBar>> {
        self.bar
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
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
        *self.bar() = Some(pb);
    }
    fn inc(&self, n: u64) {
        if let Some(pb) = self.bar().as_ref() {
            pb.inc(n);
        }
    }
    fn note(&self, line: &str) {
        match self.bar().as_ref() {
            Some(pb) if !pb.is_hidden() => pb.println(line),
            _ => eprintln!("{line}"),
        }
    }
    fn done(&self, summary: &str) {
        if let Some(pb) = self.bar().take() {
            pb.finish_and_clear();
        }
        if !summary.is_empty() {
            eprintln!("{summary}");
        }
    }
}
